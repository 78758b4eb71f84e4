"""Which kernel computes an MLP's first GEMM and its activation on CUDA in half precision, and the policy that
picks one. x [N, E] -> the hidden [N, I] the down projection reads; three forms (FORMS):

  swiglu      Qwen2.5: silu(x @ Wg^T + bg) * (x @ Wu^T + bu); weight [2 * I, E], gate rows first (as
              models/layers.py stores gate_up_proj); bias [2 * I]
  gelu_tanh   Qwen3's fc1: gelu_tanh(x @ W^T + b); weight [I, E]
  quick_gelu  Qwen2's fc1: quick_gelu(x @ W^T + b); weight [I, E]

Each form's backends in auto's order, measured on the H100 (benchmarks/mlp_kernels/; RESULTS.md, issue
23), each `run(x, weight, bias, out) -> out [N, I]`; the last is the fallback, present wherever the fast path
runs (Triton on CUDA), which needs no check:
  swiglu:     quack         quack-kernels' CuTe DSL GEMM with its swiglu epilogue on the concatenated weight
                            (ops/quack_gemm.py; optional, comes with FlashAttention-4; sm90; tile config pinned):
                            0.248 ms at Qwen2.5 1080p, the GEMM alone 0.259
              triton_fused  our Triton GEMM with the SwiGLU in its epilogue (ops/swiglu_gemm_triton.py; TMA,
                            sm90+): 0.310 ms
              split         cuBLAS for the whole [N, 2 * I] product, then our Triton silu_mul that reads it back
                            (the path before issue 23): 0.336 ms
  gelu_tanh:  quack         gemm_act "gelu_tanh_approx": 0.118 ms at Qwen3 1080p
              cublaslt      torch._addmm_activation: cuBLASLt's GELU epilogue (tanh approximation): 0.134 ms
  quick_gelu: quack         gemm_act "quick_gelu"
              torch         cuBLAS GEMM + bias, then quick_gelu in torch ops (the towers' eager order)

`MlpKernelPolicy(choice)`, a checked backend chain (ops/backend_chain.py): auto walks each form's order; a
named choice puts that backend first in the forms that have it (then auto's order) and runs the fallback in
the others (so "split" is the service before issue 23 for every form). Per (form, device, dtype, E, I) the
first backend that is present and passes `check_backend` runs: numerics against float32 on a small batch at
the real E and I (output poisoned with NaN first, so an unwritten element fails), eagerly and replayed in a
captured graph on fresh inputs. The check runs at the first call with a new key outside graph capture (the
runners' warm-up before each capture is such a call); a call inside a capture for a key not yet checked runs
the fallback (nothing compiles or syncs inside a capture). A backend that fails is demoted for that key
(logged) and the next one is checked. The towers reach this through ops/activation.py, under the policy
`use_policy` made active on the thread, else the default (auto).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from encoder_service.ops import quack_gemm, swiglu_gemm_triton
from encoder_service.ops.fast_path import HALF_PRECISION, tl, triton
from encoder_service.ops.backend_chain import (
    BackendChain,
    ThreadPolicy,
    check_against_float32,
    dtype_name,
    nan_elements,
    relative_error,
)

log = logging.getLogger(__name__)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELU (Qwen2-VL's hidden_act)."""
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Qwen3-VL's gelu_pytorch_tanh)."""
    return F.gelu(x, approximate="tanh")


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


# ---- backends -----------------------------------------------------------------------------------------


def _split(x, weight, bias, out):
    return silu_mul_triton(F.linear(x, weight, bias), out)


def _triton_fused(x, weight, bias, out):
    return swiglu_gemm_triton.swiglu_gemm_triton(x, weight, bias, out=out)


def _quack(activation: str):
    def run(x, weight, bias, out):
        return quack_gemm.gemm_act_quack(x, weight, bias, activation, out=out)

    return run


def _cublaslt_gelu(x, weight, bias, out):
    if out is None:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True, out=out)


def _torch_quick_gelu(x, weight, bias, out):
    hidden = quick_gelu(F.linear(x, weight, bias))
    return hidden if out is None else out.copy_(hidden)


def _probe_quack(device, e, i) -> str:
    ok, why = quack_gemm.available(device)
    if not ok:
        return why
    return "" if e % 8 == 0 and i % 8 == 0 else f"E={e} and I={i} must be multiples of 8 (16-byte rows)"


def _present(device, e, i) -> str:
    return ""


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[..., torch.Tensor]  # (x, weight, bias, out) -> out
    probe: Callable[[torch.device, int, int], str]  # (device, E, I) -> '' if usable, else why not


@dataclass(frozen=True)
class Form:
    """An MLP's first GEMM + activation: its backends in auto's order (the last: the fallback) and its
    float32 reference."""

    name: str
    gated: bool  # weight [2 * I, E] (gate | up) -> [N, I], else weight [I, E]
    act: Callable[[torch.Tensor], torch.Tensor]  # silu for the gated form: act(gate) * up
    backends: tuple[Backend, ...]

    @property
    def fallback(self) -> str:
        return self.backends[-1].name

    def backend(self, name: str) -> Backend:
        return next(b for b in self.backends if b.name == name)

    def chain(self, choice: str) -> tuple[str, ...]:
        names = tuple(b.name for b in self.backends)
        if choice == "auto":
            return names
        if choice not in names:
            return (self.fallback,)
        chain = tuple(dict.fromkeys((choice, *names)))
        return chain[: chain.index(self.fallback) + 1]  # the fallback ends it (named: it runs alone)

    def width(self, weight: torch.Tensor) -> int:
        """I, the hidden width, from the weight's rows."""
        return weight.shape[0] // 2 if self.gated else weight.shape[0]

    def reference(self, x, weight, bias) -> torch.Tensor:
        """The float32 hidden on x's device (two GEMMs on the halves for the gated form)."""
        x32, w32, b32 = x.float(), weight.float(), bias.float()
        if not self.gated:
            return self.act(F.linear(x32, w32, b32))
        i = self.width(weight)
        return self.act(F.linear(x32, w32[:i], b32[:i])) * F.linear(x32, w32[i:], b32[i:])


FORMS: dict[str, Form] = {f.name: f for f in (
    Form("swiglu", True, F.silu, (Backend("quack", _quack("swiglu"), _probe_quack),
                                  Backend("triton_fused", _triton_fused, swiglu_gemm_triton.serves),
                                  Backend("split", _split, _present))),
    Form("gelu_tanh", False, gelu_tanh, (Backend("quack", _quack("gelu_tanh_approx"), _probe_quack),
                                         Backend("cublaslt", _cublaslt_gelu, _present))),
    Form("quick_gelu", False, quick_gelu, (Backend("quack", _quack("quick_gelu"), _probe_quack),
                                           Backend("torch", _torch_quick_gelu, _present))),
)}
CHOICES = ("auto", *dict.fromkeys(b.name for f in FORMS.values() for b in f.backends))

CHECK_ROWS = 777  # odd: partial row tiles
CHECK_REL_TOL = 1e-2  # ||out - ref|| / ||ref|| against float32; one bf16 rounding is ~3e-3


# ---- the policy ---------------------------------------------------------------------------------------


class MlpKernelPolicy(BackendChain[tuple[str, torch.device, torch.dtype, int, int]]):
    """Which backend computes each form, per key (form, device, dtype, E, I); see the module docstring and
    ops/backend_chain.py. `available` fakes a backend's probe by its name (tests; benchmarks leave one out)."""

    CHOICES = CHOICES
    kind = "MLP kernel"
    log = log

    def chain(self, key) -> tuple[str, ...]:
        return FORMS[key[0]].chain(self.choice)

    def label(self, key) -> str:
        form, device, dtype, e, i = key
        return f"{form}/{device}/E{e}/I{i}/{dtype_name(dtype)}"

    def demotion_note(self, name: str, key) -> str:
        form, _, dtype, e, i = key
        return f"MLP kernel {name} demoted for {form} E={e} I={i} {dtype_name(dtype)}"

    def run(self, form: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        f = FORMS[form]
        key = (form, x.device, x.dtype, x.shape[-1], f.width(weight))
        name = self.picked(key)
        if name is None:
            if torch.cuda.is_current_stream_capturing():
                name = f.fallback  # unchecked: nothing may compile or sync inside a capture
            else:
                name = self.select(*key)
        return f.backend(name).run(x, weight, bias, None)

    def select(self, form: str, device: torch.device, dtype: torch.dtype, e: int, i: int) -> str:
        """The backend for this key, running the startup check of each candidate in turn (once per key): a
        backend that is not here (its probe) or fails `check_backend` is demoted."""
        f = FORMS[form]

        def check(name: str) -> str:
            backend = f.backend(name)
            return (self.why_absent(name, lambda: backend.probe(device, e, i), remember=False)
                    or check_backend(f, backend.run, device, dtype, e, i))

        return self.pick_checked((form, device, dtype, e, i), device, check)


def check_backend(form: Form, run, device, dtype, e: int, i: int, rows: int = CHECK_ROWS) -> str:
    """'' if `run` computes `form` like the float32 reference at these widths, eagerly and replayed in a
    captured graph, else what went wrong. Inputs from a CPU generator (the default CUDA RNG untouched)."""
    gen = torch.Generator().manual_seed(e * 7 + i)

    def fresh(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    def inputs():
        n = 2 * i if form.gated else i
        x, weight, bias = fresh(rows, e), fresh(n, e, scale=e**-0.5), fresh(n, scale=0.5)
        out = torch.full((rows, i), float("nan"), device=device, dtype=dtype)  # an unwritten element fails
        return (lambda: run(x, weight, bias, out), lambda: form.reference(x, weight, bias),
                lambda: x.copy_(fresh(rows, e)))

    compare = functools.partial(relative_error, rel_tol=CHECK_REL_TOL, nans=nan_elements)
    return check_against_float32(inputs, compare, device, capture=True)


# ---- the active policy ------------------------------------------------------------------------------

_policy: ThreadPolicy[MlpKernelPolicy] = ThreadPolicy(MlpKernelPolicy)
# active_policy(): the policy use_policy(policy) made active on this thread (around a forward or a graph
# capture: the captured graph keeps the kernels it recorded), else the default (auto, made on first use).
active_policy = _policy.active
use_policy = _policy.use


def run(form: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The hidden of `form` for x on CUDA in half precision, by the active policy's backend."""
    assert x.is_cuda and x.dtype in HALF_PRECISION and triton is not None
    return active_policy().run(form, x, weight, bias)
