"""quack's GEMM with an activation in its epilogue (`quack-kernels`, CuTe DSL), the optional backend of the
MLPs' first GEMM (ops/mlp_kernels.py): `gemm_act_quack(x, weight, bias, activation)` ->

    "swiglu"            weight [2 * I, E], gate rows first: silu(x @ Wg^T + bg) * (x @ Wu^T + bu)  [N, I]  Qwen2.5
    "gelu_tanh_approx"  weight [I, E]: gelu_tanh(x @ W^T + b)  [N, I]                                    Qwen3 fc1
    "quick_gelu"        weight [I, E]: x' * sigmoid(1.702 x'), x' = x @ W^T + b  [N, I]                   Qwen2 fc1

Bias and activation (and the gated product) in float32 on the accumulator, one rounding at the store; the
pre-activation is not written (store_preact=False).

quack comes with FlashAttention-4 (a dependency of flash-attn-4); imported only on a CUDA device of compute
capability 9.x when the policy asks for it, never on the CPU, never at import of this module. From its sources
(quack-kernels 0.6.5, quack/gemm_interface.py: gemm_act; quack/epilogue/library.py: linear_act_mod):
  - `gemm_act(A [N, E], B [E, N'], bias, activation, concat_layout=("B", "bias"))`: for "swiglu" B's N' dim
    (our weight's rows, transposed: a view) holds [gate; up] concatenated, as models/layers.py stores
    `gate_up_proj`; the kernel reads it interleaved through its layout, and a 16-bit bias is interleaved by a
    small copy per call. The plain activations take any name of quack.activation.act_fn_map ("quick_gelu"
    is there, not in gemm_act's type hints).
  - `tuned=False, config=CONFIGS[activation]`: no autotuning at the first call (the autotuner sweeps ~20
    configs per new shape, timing each). "swiglu" pins 128 x 192 tiles, pingpong, cluster 1 x 2 (the
    fastest of the sweep of benchmarks/mlp_kernels/ on the H100: 0.248 ms at Qwen2.5 1080p against 0.256
    for quack's sm90 default, cluster 2 x 1); None is quack's default (gelu_tanh_approx: 0.118 ms for Qwen3's
    1080p fc1 against cuBLASLt's 0.134). JIT: `cute.compile` once per (dtypes, layouts, config, epilogue),
    M symbolic; compiled objects cached on disk (QUACK_CACHE_DIR, default /tmp/<user>/quack_cache). Launch
    on torch's current stream through TVM-FFI (like FA4): capturable, checked by the policy's startup check
    in a graph.
  - Its epilogue's compile key fingerprints the epilogue function and everything it references, treating
    code outside a `site-packages` / `dist-packages` folder as quack's own and recursing into it
    (quack/gemm_runtime/identity.py: `_is_extern_function`). Installed with `pip install --target /tmp/site`
    the CuTe DSL is not under such a folder, the recursion reaches nvidia-cutlass-dsl 4.8.1's `_LOC_TRANSFORMS`
    ContextVar (cutlass/_mlir_helpers/op.py) and `import quack.epilogue.library` raises TypeError.
    scripts/gpu/install_wheels.sh installs into /tmp/site-packages for that reason.
"""

from __future__ import annotations

import torch

from encoder_service.ops.cutlass_dsl import DslImport

GATED = ("swiglu",)
# Pinned GemmConfig fields (quack.gemm_config.GemmConfig) per activation; absent or None: quack's default.
CONFIGS: dict[str, dict | None] = {
    "swiglu": dict(tile_m=128, tile_n=192, pingpong=True, cluster_m=1, cluster_n=2, is_dynamic_persistent=False),
}

PINNED = "pinned"  # gemm_act_quack's fields: CONFIGS' entry for the activation


def _load():
    import quack.epilogue.library  # noqa: F401 - builds (and fingerprints) quack's epilogues: fails here
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_act

    return gemm_act, GemmConfig


QUACK = DslImport("quack.gemm_interface", _load, majors=(9,),
                  arch_note="quack's GEMMs are used on sm90 only (the one measured)")
# available(device) -> (usable, why not): imports quack on the first call for a CUDA device of sm90.
available = QUACK.available


def gemm_config(fields: dict | None):
    """quack's GemmConfig for these fields (None: quack's default, returned as None)."""
    if fields is None:
        return None
    _, config_cls = QUACK.require()
    return config_cls(**fields)


def gemm_act_quack(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, activation: str, *,
                   fields: dict | None | str = PINNED, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, E], weight [2 * I, E] (gated) or [I, E], bias [2 * I] or [I] -> [N, I] (into `out` if given).
    `fields`: GemmConfig fields, None for quack's default, PINNED for CONFIGS' pin of the activation."""
    fn, _ = QUACK.require()
    config = gemm_config(CONFIGS.get(activation) if fields is PINNED else fields)
    gated = activation in GATED
    _, post = fn(x.contiguous(), weight.t(), bias=bias, activation=activation, postact_out=out, store_preact=False,
                 tuned=False, config=config, concat_layout=("B", "bias") if gated else None)
    return post
