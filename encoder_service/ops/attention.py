"""The towers' one attention op: non-causal attention over packed variable-length segments.

`varlen_attention(q, k, v, cu_seqlens, max_seqlen)`: q, k, v `[N, heads, head_dim]` (v may be a strided
view: the fused qkv output's [:, 2]); segment i is rows `cu_seqlens[i]:cu_seqlens[i+1]` (int32,
`[num_segments + 1]`, cu_seqlens[0] = 0 and cu_seqlens[-1] = N: every row is in a segment, as the towers'
metadata makes it; zero-length segments allowed); `max_seqlen` a Python int >= every segment's length.
Tokens attend only within their segment. Returns `[N, heads, head_dim]`.

  - CPU: one SDPA call per segment (ops/attention_torch.py: `per_segment_attention`, the towers' eager
    order: bfloat16 results equal transformers'). In float32 it is also `reference_attention`, the
    numerics every CUDA backend is checked against (tests/gpu/test_ops_cuda.py,
    benchmarks/attention/candidates.py, the startup check).
  - CUDA, bfloat16 / float16: an `AttentionPolicy` picks a backend per LAYOUT CLASS and head dim from
    Python ints only (shapes, the number of segment slots, max_seqlen: capturable, no host sync), from
    TABLE below, the first backend that is installed, imports, serves the layout and passed its startup
    check (the chain, its demotions and the check: ops/backend_chain.py). The backends (BACKENDS):
    FlashAttention-4 (ops/attention_fa4.py, optional dependency), our Triton short-segment kernel for
    windows (ops/attention_triton.py), and torch's own (ops/attention_torch.py: dense SDPA, the two-segment
    dense trick, `varlen_attn`, a masked dense last resort).
    The choice is the runner's (`--attention {auto,fa4,torch}`, env ENCODER_ATTENTION: settings.py),
    made active around its forward with `use_policy`; outside a runner (tests, scripts calling a tower
    directly) the default policy (auto) runs, without the startup check (a backend that raises still falls
    back).
  - CUDA in float32 / float64: `masked_dense_attention` (the reference order on the device).

Not used: cuDNN's ragged kernel through aten (`_cudnn_attention_forward` with cum_seq offsets): captured in
a CUDA graph on torch 2.11 it left the CUDA RNG raising "Offset increment outside graph capture" on every
later random op. benchmarks/attention/candidates.py measures cudnn-frontend's own ragged graph instead.
Nor our head-dim-split Triton varlen kernel (formerly `--attention triton`): slower than FA4 on every layout
and wrong on several on the H100; benchmarks/attention/triton_split.py keeps it as a rejected candidate.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from encoder_service.ops import attention_fa4, attention_torch, attention_triton
from encoder_service.ops.attention_torch import (
    dense_sdpa,
    masked_dense_attention,
    per_segment_attention,
    reference_attention,
    two_segment_dense_attention,
    varlen_attention_torch,
)
from encoder_service.ops.attention_triton import SHORT_SEGMENT_MAX
from encoder_service.ops.backend_chain import (
    BackendChain,
    ThreadPolicy,
    check_against_float32,
    dtype_name,
    nan_rows,
    relative_error,
)
from encoder_service.ops.fast_path import HALF_PRECISION, triton

log = logging.getLogger(__name__)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    if q.is_cuda:
        return active_policy().attention(q, k, v, cu_seqlens, max_seqlen)
    return per_segment_attention(q, k, v, cu_seqlens)


# ---- layout classes and backends ----------------------------------------------------------------

# What a call's Python ints say about its segments (N rows, S slots, max_seqlen); `layout_class`.
ONE = "one"  # one segment, all rows: an image alone (eager), exact-bucket graphs
WINDOWS = "windows"  # max_seqlen <= 64: Qwen2.5's window layers (real windows, dummy windows, empty slots)
PADDED_SINGLE = "padded_single"  # 2 slots, max_seqlen >= N: one image + a graph's dummy rows ("single" graphs)
SEVERAL = "several"  # several segments: multi-image graphs (filler slots, max_seqlen = bucket), eager batches, frames
LAYOUTS = (ONE, PADDED_SINGLE, SEVERAL, WINDOWS)


def layout_class(n: int, num_segments: int, max_seqlen: int) -> str:
    if num_segments == 1 and max_seqlen >= n:
        return ONE
    if max_seqlen <= SHORT_SEGMENT_MAX:
        return WINDOWS
    if num_segments == 2 and max_seqlen >= n:
        return PADDED_SINGLE
    return SEVERAL


@dataclass(frozen=True)
class Backend:
    """One attention implementation with the op's signature and what it needs to be correct."""

    name: str
    run: Callable[..., torch.Tensor]  # (q, k, v, cu_seqlens, max_seqlen) -> out
    layouts: frozenset  # the layout classes it is correct for (its precondition, decided from ints)
    needs: str  # what must be present: "torch", "varlen_attn", "triton", "fa4"
    min_head_dim: int = 1
    max_head_dim: int = 256
    head_dim_multiple: int = 1

    def serves(self, cls: str, head_dim: int) -> bool:
        return (cls in self.layouts and self.min_head_dim <= head_dim <= self.max_head_dim
                and head_dim % self.head_dim_multiple == 0)


_ANY = frozenset(LAYOUTS)
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("fa4", attention_fa4.fa4_attention, _ANY, "fa4", min_head_dim=8, max_head_dim=128, head_dim_multiple=8),
    Backend("triton_short", attention_triton.short_segment_attention, frozenset({WINDOWS}), "triton",
            max_head_dim=128),
    Backend("torch_dense", lambda q, k, v, cu, max_seqlen: dense_sdpa(q, k, v), frozenset({ONE}), "torch"),
    Backend("torch_two_segment", lambda q, k, v, cu, max_seqlen: two_segment_dense_attention(q, k, v, cu),
            frozenset({PADDED_SINGLE}), "torch"),
    Backend("torch_varlen", varlen_attention_torch, _ANY, "varlen_attn"),
    Backend("torch_masked", lambda q, k, v, cu, max_seqlen: masked_dense_attention(q, k, v, cu), _ANY, "torch"),
)}
LAST_RESORT = "torch_masked"  # always present and correct; O(N^2) memory

# ---- the selection table ------------------------------------------------------------------------
# Preference per layout class under --attention auto: the first backend that is present, serves the
# layout and head dim, and passed the startup check runs; LAST_RESORT closes every chain. The order is
# what the H100 measured (benchmarks/RESULTS.md, "Attention candidates per layout"): FA4 before cuDNN's
# dense SDPA for full layers, our short-segment kernel before FA4 for Qwen2.5's windows.
TABLE: dict[str, tuple[str, ...]] = {
    ONE: ("fa4", "torch_dense"),
    PADDED_SINGLE: ("fa4", "torch_two_segment"),
    SEVERAL: ("fa4", "torch_varlen"),
    WINDOWS: ("triton_short", "torch_varlen"),
}

CHOICES = ("auto", "fa4", "torch")
# --attention torch: torch's kernels only (no optional dependency, no Triton attention).
TORCH_ONLY = {ONE: ("torch_dense",), PADDED_SINGLE: ("torch_two_segment",), SEVERAL: ("torch_varlen",),
              WINDOWS: ("torch_varlen",)}


def chain(choice: str, cls: str) -> tuple[str, ...]:
    """The backends tried, in order, for one layout class under `choice` (those that do not serve the head
    dim are passed over): a forced choice puts its backends first and falls back along auto's chain (torch:
    torch's own chain)."""
    auto = TABLE[cls]
    if choice == "auto":
        names = auto
    elif choice == "fa4":
        names = ("fa4",) + auto
    elif choice == "torch":
        names = TORCH_ONLY[cls]
    else:
        raise ValueError(f"attention choice must be one of {', '.join(CHOICES)}, got {choice!r}")
    return tuple(dict.fromkeys(names + (LAST_RESORT,)))


def _probe(needs: str, device: torch.device) -> str:
    """'' if what a backend needs is here on this device, else why not. Imports FA4 (CUDA only)."""
    if needs == "torch":
        return ""
    if needs == "varlen_attn":
        return "" if attention_torch.varlen_attn is not None else "torch.nn.attention.varlen needs torch >= 2.10"
    if needs == "triton":
        return "" if triton is not None else "triton is not installed"
    if needs == "fa4":
        ok, why = attention_fa4.available(device)
        return "" if ok else why
    raise ValueError(needs)


@dataclass(frozen=True)
class CheckCase:
    """A small layout of one class for the startup check (its lengths, then zero-length filler slots)."""

    lengths: tuple[int, ...]
    slots: int
    max_seqlen: int

    @property
    def bounds(self) -> list[int]:
        b = [0]
        for length in self.lengths:
            b.append(b[-1] + length)
        return b + [b[-1]] * (self.slots + 1 - len(b))


_WINDOW_LENGTHS = (64, 48, 16, 12)
# Per class: the variants a backend may compile separately (FA4: max_seqlen within one 192-row tile or
# not; more than 256 segments), each small (the reference runs too).
CHECK_CASES: dict[str, tuple[CheckCase, ...]] = {
    ONE: (CheckCase((1024,), 1, 1024), CheckCase((96,), 1, 96)),
    PADDED_SINGLE: (CheckCase((700, 324), 2, 1024),),
    SEVERAL: (CheckCase((300, 0, 257, 64, 1, 402), 12, 1024), CheckCase((100, 40, 150), 3, 150)),
    WINDOWS: (CheckCase(_WINDOW_LENGTHS * 10, 48, 64), CheckCase((16, 12) * 135, 272, 64)),
}
CHECK_REL_TOL = 2e-2  # ||out - ref|| / ||ref|| against float32; bf16 attention lands near 2e-3


class AttentionPolicy(BackendChain[tuple[str, int, torch.dtype]]):
    """Which backend serves each (layout class, head dim, dtype), for one runner (one device): `choice`
    (CHOICES; auto = TABLE), what is present (probed once per requirement; tests pass `available` instead),
    backends demoted by the startup check (`check`) or by a failed eager call, and the record of what was
    selected (ops/backend_chain.py)."""

    CHOICES = CHOICES
    kind = "attention"
    log = log

    def chain(self, key) -> tuple[str, ...]:
        return chain(self.choice, key[0])

    def usable(self, name: str, key, device: torch.device) -> bool:
        cls, head_dim, _ = key
        return BACKENDS[name].serves(cls, head_dim) and not self.missing(BACKENDS[name].needs, device)

    def label(self, key) -> str:
        cls, head_dim, dtype = key
        return f"{cls}/D{head_dim}/{dtype_name(dtype)}"

    def demoted_label(self, name: str, key) -> str:
        cls, head_dim, _ = key
        return f"{name}@{cls}/D{head_dim}"

    def demotion_note(self, name: str, key) -> str:
        cls, head_dim, dtype = key
        return f"attention: {name} demoted for {cls} layouts (head dim {head_dim}, {dtype_name(dtype)})"

    # -- selection (Python ints only) --------------------------------------------------------------

    def missing(self, needs: str, device: torch.device) -> str:
        return self.why_absent(needs, lambda: _probe(needs, device))

    def select(self, n: int, num_segments: int, max_seqlen: int, head_dim: int, dtype: torch.dtype,
               device: torch.device) -> str:
        return self.pick((layout_class(n, num_segments, max_seqlen), head_dim, dtype), device)

    # -- the op --------------------------------------------------------------------------------------

    def attention(self, q, k, v, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        if q.dtype not in HALF_PRECISION:
            return masked_dense_attention(q, k, v, cu_seqlens)
        n, _, d = q.shape
        s = cu_seqlens.shape[0] - 1
        name = self.select(n, s, max_seqlen, d, q.dtype, q.device)
        try:
            return BACKENDS[name].run(q, k, v, cu_seqlens, max_seqlen)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # a backend that raises (a JIT compile, an unsupported case): the next one
            if name == LAST_RESORT or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                raise
            self.demote(name, (layout_class(n, s, max_seqlen), d, q.dtype), f"{type(e).__name__}: {str(e)[:300]}")
            return self.attention(q, k, v, cu_seqlens, max_seqlen)

    # -- startup check -------------------------------------------------------------------------------

    def check(self, *, head_dim: int, num_heads: int, dtype: torch.dtype, device, layouts=LAYOUTS,
              capture: bool = False) -> None:
        """Before any request (and before graph capture): for each layout class in `layouts`, the selected
        backend runs CHECK_CASES (compiling its kernels: Triton, FA4's JIT) on random q, k and a strided v,
        compared with `reference_attention`; with capture=True also captured in a CUDA graph and replayed on
        new inputs into the same buffers (output poisoned with NaN first). A backend that raises or differs
        is demoted for that class and the next one is checked. Only CUDA in half precision."""
        device = torch.device(device)
        if device.type != "cuda" or dtype not in HALF_PRECISION:
            return

        def check(name: str, case: CheckCase) -> str | None:
            return check_backend(BACKENDS[name].run, case, num_heads, head_dim, dtype, device, capture)

        for cls in layouts:
            for case in CHECK_CASES[cls]:
                self.pick_checked((cls, head_dim, dtype), device, functools.partial(check, case=case),
                                  check_id=(case, capture))

    # -- what ran ---------------------------------------------------------------------------------------

    def describe(self) -> dict:
        return {"choice": self.choice, "selected": self.selected(), "missing": self.absences(),
                "demoted": self.demotions()}

    def summary(self) -> str:
        d = self.describe()
        parts = [f"{k} -> {v}" for k, v in d["selected"].items()] or ["nothing selected yet"]
        notes = [f"{need} unavailable ({why})" for need, why in d["missing"].items()]
        notes += [f"{k} demoted ({why})" for k, why in d["demoted"].items()]
        return f"attention ({self.choice}): " + ", ".join(parts) + ("; " + "; ".join(notes) if notes else "")


def check_backend(run, case: CheckCase, num_heads: int, head_dim: int, dtype, device, capture: bool) -> str | None:
    """None if `run` matches the float32 reference on `case` (eager, and replayed in a CUDA graph if
    `capture`), else what went wrong. Inputs come from a CPU generator (the default CUDA RNG untouched)."""
    bounds = case.bounds
    n = bounds[-1]
    gen = torch.Generator().manual_seed(n * 31 + case.slots)

    def fresh():
        return torch.randn(n, 3, num_heads, head_dim, generator=gen).to(device, dtype)

    def inputs():
        qkv = fresh()
        q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]  # v strided, as in the towers
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)

        def refill():
            qkv.copy_(fresh())
            q.copy_(qkv[:, 0])
            k.copy_(qkv[:, 1])

        return lambda: run(q, k, v, cu, case.max_seqlen), lambda: reference_attention(q, k, v, cu), refill

    compare = functools.partial(relative_error, rel_tol=CHECK_REL_TOL, nans=nan_rows)
    return check_against_float32(inputs, compare, device, capture=capture) or None


# ---- the active policy ----------------------------------------------------------------------------

_policy: ThreadPolicy[AttentionPolicy] = ThreadPolicy(AttentionPolicy)
# active_policy(): the policy use_policy(policy) made active on this thread (a runner, around its forward and
# captures), else the default (auto, made on first use, without the startup check).
active_policy = _policy.active
use_policy = _policy.use
