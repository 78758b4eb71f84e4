"""quack's GEMM with a gated-activation epilogue (`quack-kernels`, CuTe DSL) as an optional backend of the
gated MLP: `swiglu_gemm_quack(x, weight, bias)` -> silu(x @ Wg^T + bg) * (x @ Wu^T + bu) [N, I].

quack comes with FlashAttention-4 (a dependency of flash-attn-4); imported only on a CUDA device of compute
capability 9.x when ops/mlp_kernels.py's policy asks for it, never on the CPU, never at import of this
module. From its sources (quack-kernels 0.6.5, quack/gemm_interface.py: gemm_act / gemm_gated):
  - `gemm_act(A [N, E], B [E, 2I], bias, activation="swiglu", concat_layout=("B", "bias"))`: B's N dim
    (our weight's rows, transposed: a view) holds [gate; up] concatenated, as models/layers.py stores
    `gate_up_proj`; the kernel reads it interleaved through its layout, and a 16-bit bias is interleaved by a
    small copy per call. Bias, SiLU and the product in float32 in the epilogue; output [N, I].
  - `tuned=False, config=CONFIG`: no autotuning at first call (the autotuner sweeps ~20 configs per new
    shape, timing each); CONFIG None is quack's per-arch default (sm90: 128 x 192 tile, cluster 2 x 1,
    pingpong). JIT: `cute.compile` once per (dtypes, layouts, config, epilogue), M symbolic; compiled
    objects cached on disk (QUACK_CACHE_DIR, default /tmp/<user>/quack_cache). Launch on torch's current
    stream through TVM-FFI (like FA4): capturable, checked by the policy's startup check in a graph.
  - Its epilogue's compile key fingerprints the epilogue function and everything it references, treating
    code outside a `site-packages` / `dist-packages` folder as quack's own and recursing into it
    (quack/gemm_runtime/identity.py: `_is_extern_function`). Installed with `pip install --target /tmp/site`
    the CuTe DSL is not under such a folder, the recursion reaches nvidia-cutlass-dsl 4.8.1's `_LOC_TRANSFORMS`
    ContextVar (cutlass/_mlir_helpers/op.py) and `import quack.epilogue.library` raises TypeError.
    scripts/gpu/install_wheels.sh installs into /tmp/site-packages for that reason.
"""

from __future__ import annotations

import torch

from encoder_service.ops.cutlass_dsl import ensure_dsl_path

# Pinned GemmConfig fields (quack.gemm_config.GemmConfig), or None for quack's sm90 default.
CONFIG: dict | None = None

# (gemm_act, GemmConfig, None) after a successful import, (None, None, reason) after a failed one.
_loaded: tuple | None = None


def _import():
    global _loaded
    if _loaded is None:
        try:
            ensure_dsl_path()
            import quack.epilogue.library  # noqa: F401 - builds (and fingerprints) quack's epilogues: fails here
            from quack.gemm_config import GemmConfig
            from quack.gemm_interface import gemm_act

            _loaded = (gemm_act, GemmConfig, None)
        except Exception as e:  # ImportError, OSError, the fingerprint's TypeError: all mean "not usable here"
            _loaded = (None, None, f"import quack.gemm_interface failed: {type(e).__name__}: {str(e)[:300]}")
    return _loaded


def available(device: torch.device) -> tuple[bool, str]:
    """(usable, why not). Imports quack on the first call for a CUDA device of sm90."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return False, f"sm{major}{minor}: quack's gated GEMM is used on sm90 only (the one measured)"
    fn, _, why = _import()
    return fn is not None, why or ""


def gemm_config(fields: dict | None = None):
    """quack's GemmConfig for these fields (None: CONFIG; CONFIG None: quack's default, returned as None)."""
    fields = CONFIG if fields is None else fields
    if fields is None:
        return None
    _, config_cls, why = _import()
    if config_cls is None:
        raise RuntimeError(why)
    return config_cls(**fields)


def swiglu_gemm_quack(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, config=None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, E] x [2 * I, E] (+ bias [2 * I]) -> silu(gate) * up [N, I]; `config` a quack GemmConfig (None:
    gemm_config()); `out` [N, I] if given."""
    fn, _, why = _import()
    if fn is None:
        raise RuntimeError(why)
    _, post = fn(x.contiguous(), weight.t(), bias=bias, activation="swiglu", postact_out=out, store_preact=False,
                 tuned=False, config=config if config is not None else gemm_config(), concat_layout=("B", "bias"))
    return post
