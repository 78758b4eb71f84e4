"""Which kernel computes Qwen2.5's gated MLP hidden on CUDA in half precision, and the policy that picks one.

    hidden = silu(x @ Wg^T + bg) * (x @ Wu^T + bu)     x [N, E]; weight [2 * I, E], gate rows first (as
                                                        models/layers.py stores gate_up_proj); bias [2 * I]
Backends (BACKENDS), each `run(x, weight, bias, out) -> out [N, I]`:
  - split:        cuBLAS for the whole [N, 2 * I] product, then our Triton silu_mul that reads it back (the
                  path before issue 23; needs only Triton)
  - triton_fused: one Triton GEMM with the SwiGLU in its epilogue (ops/swiglu_gemm_triton.py; TMA, sm90+)
  - quack:        quack-kernels' CuTe DSL GEMM with its swiglu epilogue (ops/swiglu_gemm_quack.py; optional
                  dependency that comes with FlashAttention-4; sm90)
`GatedKernelPolicy(choice)`: auto walks TABLE; a named choice puts its backend first and falls back along
auto's chain, which always ends in split. Per (device, dtype, E, I) the first backend that is present and
passes `check_backend` runs: numerics against float32 on a small batch at the real E and I (output poisoned
with NaN first, so an unwritten element fails), eagerly and replayed in a captured graph on fresh inputs.
The check runs at the first call with a new key outside graph capture (the runners' warm-up before each
capture is such a call); a call inside a capture for a key not yet checked runs split, which needs no check
(nothing compiles or syncs inside a capture). A backend that fails is demoted for that key (logged) and the
next one is checked. The towers reach this through ops/activation.py (`gated_linear_act`), under the policy
`use_policy` made active on the thread, else the default (auto).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from encoder_service.ops import swiglu_gemm_quack, swiglu_gemm_triton
from encoder_service.ops.fast_path import HALF_PRECISION, tl, triton

log = logging.getLogger(__name__)


# ---- split: cuBLAS, then Triton silu_mul ------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, N, I, BLOCK: tl.constexpr):
        # gu [N, 2*I]: gate | up. out [N, I] = silu(gate) * up, silu rounded to the model dtype first (as torch).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(gu_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=mask, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
        out = (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * I + cols, out, mask=mask)


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, 2 * I] (gate | up) -> silu(gate) * up [N, I] (into `out` if given)."""
    n, two_i = gate_up.shape
    i = two_i // 2
    if out is None:
        out = torch.empty(n, i, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up.contiguous(), out, n, i, BLOCK=block, num_warps=4)
    return out


def _split(x, weight, bias, out):
    return silu_mul_triton(F.linear(x, weight, bias), out)


def _triton_fused(x, weight, bias, out):
    return swiglu_gemm_triton.swiglu_gemm_triton(x, weight, bias, out=out)


def _quack(x, weight, bias, out):
    return swiglu_gemm_quack.swiglu_gemm_quack(x, weight, bias, out=out)


# ---- backends and the policy ------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[..., torch.Tensor]  # (x, weight, bias, out) -> out
    probe: Callable[[torch.device, int, int], str]  # (device, E, I) -> '' if usable, else why not


def _probe_quack(device, e, i) -> str:
    ok, why = swiglu_gemm_quack.available(device)
    if not ok:
        return why
    return "" if e % 8 == 0 and i % 8 == 0 else f"E={e} and I={i} must be multiples of 8 (16-byte rows)"


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("split", _split, lambda device, e, i: ""),
    Backend("triton_fused", _triton_fused, swiglu_gemm_triton.serves),
    Backend("quack", _quack, _probe_quack),
)}
FALLBACK = "split"  # present wherever the fast path runs (Triton on CUDA); needs no check

# auto's order. Measure before changing it (benchmarks/kernels_issue23.py times every backend per kernel
# and end to end on the H100 and prints the order its numbers support).
TABLE: tuple[str, ...] = ("split",)
CHOICES = ("auto", *BACKENDS)

CHECK_ROWS = 777  # odd: partial row tiles
CHECK_REL_TOL = 1e-2  # ||out - ref|| / ||ref|| against float32; one bf16 rounding is ~3e-3


def chain(choice: str) -> tuple[str, ...]:
    if choice not in CHOICES:
        raise ValueError(f"MLP kernel choice must be one of {', '.join(CHOICES)}, got {choice!r}")
    names = TABLE if choice == "auto" else (choice, *TABLE)
    return tuple(dict.fromkeys(names + (FALLBACK,)))


class GatedKernelPolicy:
    """Which backend computes the gated hidden, per (device, dtype, E, I); see the module docstring."""

    def __init__(self, choice: str = "auto", *, available: Mapping[str, bool | str] | None = None):
        self.choice = choice
        self.chain = chain(choice)
        # tests fake the probes: backend -> True (present) or why not
        self._available = {k: "" if v is True else str(v) for k, v in (available or {}).items()}
        self._selected: dict[tuple, str] = {}  # key -> backend that passed its check
        self._demoted: dict[tuple, str] = {}  # (backend, key) -> why
        self._lock = threading.Lock()

    def gated_silu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        key = (x.device, x.dtype, x.shape[-1], weight.shape[0] // 2)
        name = self._selected.get(key)
        if name is None:
            if torch.cuda.is_current_stream_capturing():
                name = FALLBACK  # unchecked: nothing may compile or sync inside a capture
            else:
                name = self.select(*key)
        return BACKENDS[name].run(x, weight, bias, None)

    def select(self, device: torch.device, dtype: torch.dtype, e: int, i: int) -> str:
        """The backend for this key, running the startup check of each candidate in turn (once per key)."""
        key = (device, dtype, e, i)
        with self._lock:
            if key in self._selected:
                return self._selected[key]
            for name in self.chain:
                if name == FALLBACK:
                    break
                why = (self._available[name] if name in self._available else BACKENDS[name].probe(device, e, i)) \
                    or check_backend(BACKENDS[name].run, device, dtype, e, i)
                if not why:
                    self._selected[key] = name
                    return name
                self._demoted[(name, key)] = why
                log.warning("MLP kernel %s demoted for E=%d I=%d %s: %s", name, e, i,
                            str(dtype).removeprefix("torch."), why)
            self._selected[key] = FALLBACK
            return FALLBACK

    def describe(self) -> dict:
        def label(key):
            device, dtype, e, i = key
            return f"{device}/E{e}/I{i}/{str(dtype).removeprefix('torch.')}"

        return {
            "choice": self.choice,
            "selected": {label(k): v for k, v in self._selected.items()},
            "demoted": {f"{name}@{label(k)}": why for (name, k), why in self._demoted.items()},
        }


def reference_gated_silu(x, weight, bias) -> torch.Tensor:
    """The float32 reference of the gated hidden on x's device."""
    x32, w32, b32 = x.float(), weight.float(), bias.float()
    i = weight.shape[0] // 2
    return F.silu(F.linear(x32, w32[:i], b32[:i])) * F.linear(x32, w32[i:], b32[i:])


def check_backend(run, device, dtype, e: int, i: int, rows: int = CHECK_ROWS) -> str:
    """'' if `run` matches the float32 reference at these widths eagerly and replayed in a captured graph,
    else what went wrong. Inputs from a CPU generator (the default CUDA RNG untouched)."""
    gen = torch.Generator().manual_seed(e * 7 + i)

    def fresh(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    try:
        x, weight, bias = fresh(rows, e), fresh(2 * i, e, scale=e**-0.5), fresh(2 * i, scale=0.5)
        out = torch.full((rows, i), float("nan"), device=device, dtype=dtype)
        why = _compare(run(x, weight, bias, out), reference_gated_silu(x, weight, bias))
        if why:
            return why
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run(x, weight, bias, out)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(x, weight, bias, out)
        x.copy_(fresh(rows, e))
        out.fill_(float("nan"))
        graph.replay()
        why = _compare(out, reference_gated_silu(x, weight, bias))
        del graph
        return f"in a CUDA graph: {why}" if why else ""
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure (import, JIT compile, launch) demotes the backend
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def _compare(out: torch.Tensor, ref: torch.Tensor) -> str:
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o = out.float()
    unwritten = int(o.isnan().sum())
    if unwritten:
        return f"{unwritten} elements NaN (unwritten or overflowed)"
    rel = float((o - ref).norm() / ref.norm().clamp_min(1e-30))
    return "" if rel <= CHECK_REL_TOL else f"relative error {rel:.2e} > {CHECK_REL_TOL:g} against float32"


# ---- the active policy ------------------------------------------------------------------------------

_local = threading.local()
_default: GatedKernelPolicy | None = None


def active_policy() -> GatedKernelPolicy:
    """The policy `use_policy` made active on this thread, else the default (auto, created on first use)."""
    policy = getattr(_local, "policy", None)
    if policy is not None:
        return policy
    global _default
    if _default is None:
        _default = GatedKernelPolicy()
    return _default


@contextlib.contextmanager
def use_policy(policy: GatedKernelPolicy):
    """Run the towers' gated MLP under `policy` on this thread (around a forward or a graph capture: the
    captured graph keeps the kernels it recorded)."""
    previous = getattr(_local, "policy", None)
    _local.policy = policy
    try:
        yield policy
    finally:
        _local.policy = previous


def gated_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x on CUDA in half precision, by the active policy's backend."""
    assert x.is_cuda and x.dtype in HALF_PRECISION and triton is not None
    return active_policy().gated_silu(x, weight, bias)
