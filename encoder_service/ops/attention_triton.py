"""Our Triton attention kernel (CUDA, half precision), checked against ops/attention_torch.py's reference
(`reference_attention`: float32, per segment) by tests/gpu/test_ops_cuda.py and
benchmarks/attention/candidates.py.

  - `short_segment_attention`: segments of at most 64 rows (Qwen2.5's windows): one program per
    (segment, head), the whole segment in one tile. Head dim padded to a power of two in registers.

It takes the op's contract (ops/attention.py): q, k, v [N, H, D] with a unit last-dim stride (v may be the
strided [:, 2] view of the fused qkv output: no copy), cu_seqlens int32 [S + 1] on the device (zero-length
segments allowed), max_seqlen a Python int >= every segment. One launch, grid from Python ints only, no host
sync, output from torch.empty (graph-pool memory under capture). Triton compiles on the first call of each
specialisation (dtype, D, block size, the strides' divisibility): the runners warm up before capture
(runtime/graphs.py), ops/attention.py's startup check before the first request.

A head-dim-split varlen kernel for any segment lengths used to live here too (`--attention triton`); the
H100 run found it slower than FlashAttention-4 everywhere and wrong on several layouts, so it left the
service: benchmarks/attention/triton_split.py keeps it as a rejected benchmark candidate.
"""

from __future__ import annotations

import torch

from encoder_service.ops.fast_path import tl, triton

# Segments this short go to the one-tile kernel (ops/attention.py's WINDOWS layout class).
SHORT_SEGMENT_MAX = 64


# ---- short segments (Qwen2.5 windows) -----------------------------------------------------------

if triton is not None:

    @triton.jit
    def _short_segment_attn_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, scale,
        s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_on, s_oh,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program per (segment, head): the whole segment (<= BLOCK_M rows) in one tile. Rows of a longer
        # segment past BLOCK_M are not computed (max_seqlen <= BLOCK_M is the caller's contract).
        seg = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        start = tl.load(cu_ptr + seg).to(tl.int64)
        end = tl.load(cu_ptr + seg + 1).to(tl.int64)
        length = tl.minimum(end - start, BLOCK_M)
        if length <= 0:
            return
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < length
        m2 = rmask[:, None] & (cols[None, :] < D)
        r64 = (start + rows).to(tl.int64)[:, None]
        q = tl.load(q_ptr + r64 * s_qn + h * s_qh + cols[None, :], mask=m2, other=0.0)
        k = tl.load(k_ptr + r64 * s_kn + h * s_kh + cols[None, :], mask=m2, other=0.0)
        v = tl.load(v_ptr + r64 * s_vn + h * s_vh + cols[None, :], mask=m2, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_M] float32
        s = tl.where(rmask[None, :], s, float("-inf"))
        p = tl.exp(s - tl.max(s, axis=1)[:, None])
        l = tl.sum(p, axis=1)
        o = tl.dot(p.to(v.dtype), v) / l[:, None]
        tl.store(o_ptr + r64 * s_on + h * s_oh + cols[None, :], o.to(o_ptr.dtype.element_ty), mask=m2)


def unit_last_stride(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def short_segment_attention(q, k, v, cu_seqlens, max_seqlen: int):
    """Attention within segments of at most `max_seqlen` (<= 128) rows; q, k, v [N, H, D] -> [N, H, D]."""
    q, k, v = unit_last_stride(q, k, v)
    n, h, d = q.shape
    out = torch.empty(n, h, d, device=q.device, dtype=q.dtype)
    num_segments = cu_seqlens.shape[0] - 1
    block_m = max(16, triton.next_power_of_2(max_seqlen))
    block_d = max(16, triton.next_power_of_2(d))
    if num_segments > 0 and n:
        _short_segment_attn_kernel[(num_segments, h)](
            q, k, v, out, cu_seqlens, d**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            D=d, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4 if block_m <= 64 else 8,
        )
    return out
