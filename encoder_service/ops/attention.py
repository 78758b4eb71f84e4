"""The towers' one attention op: non-causal attention over packed variable-length segments.

`varlen_attention(q, k, v, cu_seqlens, max_seqlen)`: q, k, v `[N, heads, head_dim]`; segment i is rows
`cu_seqlens[i]:cu_seqlens[i+1]` (int32, `[num_segments + 1]`, zero-length segments allowed); tokens attend
only within their segment. Returns `[N, heads, head_dim]`.

Backends, picked from the tensors' device:
  - CUDA (bf16/fp16), chosen from Python ints only (shapes and max_seqlen; capturable, no host sync;
    see `_cuda_attention` and benchmarks/RESULTS.md for the measurements behind it):
      * one segment spanning all rows: dense SDPA `[1, H, N, D]` (cuDNN; 1.4x varlen_attn);
      * max_seqlen <= 64 (Qwen2.5 windows): a Triton kernel, one tile per (segment, head), below;
      * two segments with max_seqlen >= N (one image plus the graph's dummy padding segment): one dense
        SDPA with the segment mask folded into extra head dims (exactly 0 weight across segments);
      * otherwise `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, flash).
    Not used: cuDNN's ragged kernel (`aten._cudnn_attention_forward` with cum_seq offsets): captured in a
    CUDA graph on torch 2.11 it left the CUDA RNG in a state where every later random op raised "Offset
    increment outside graph capture encountered unexpectedly".
  - CUDA without it: dense SDPA under a block-diagonal mask built on the device (no host sync; memory
    O(N^2), a correctness fallback only).
  - CPU: one SDPA call per segment, boundaries read on the host (a CPU tensor: no device sync): the
    reference (benchmarks/attention_kernels.py checks every CUDA path against it, in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder_service.ops.fast_path import HALF_PRECISION, tl, triton

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.10
    _varlen_attn = None


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    if q.is_cuda:
        return _cuda_attention(q, k, v, cu_seqlens, max_seqlen)
    return _per_segment_attention(q, k, v, cu_seqlens)


def _per_segment_attention(q, k, v, cu_seqlens):
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()  # CPU tensor: a plain read, not a device sync
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            # [L, H, D] -> [1, H, L, D]: 4-D like transformers' call, so the CPU kernel (and its bf16
            # rounding) is the same one.
            seg = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*seg)[0].transpose(0, 1)
    return out


def _masked_dense_attention(q, k, v, cu_seqlens):
    rows = torch.arange(q.shape[0], device=q.device, dtype=cu_seqlens.dtype)
    # Segment id of each row; zero-length segments repeat a boundary and own no rows.
    segment = torch.searchsorted(cu_seqlens, rows, right=True)
    mask = segment[:, None] == segment[None, :]  # [N, N] block diagonal
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), attn_mask=mask
    )
    return out.squeeze(0).transpose(0, 1)


# ---- CUDA dispatch --------------------------------------------------------------------------------

# Segments this short go to the Triton tile kernel (below) instead of varlen_attn.
SHORT_SEGMENT_MAX = 64
# Cross-segment logit offset of the two-segment dense path: exp(-C * head_dim**-0.5) is exactly 0 in
# float32 for head_dim <= 256, and C is finite in float16 and bfloat16.
_SEGMENT_PENALTY = 30000.0
# SDPA backends allowed for the dense paths (empty: torch's default choice; measured on H100:
# benchmarks/RESULTS.md).
DENSE_BACKENDS: list = []


def _dense_sdpa(q, k, v, scale=None):
    """q, k, v [N, H, D*] -> [N, H, Dv] with SDPA over all rows as one sequence."""
    args = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    if DENSE_BACKENDS:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(DENSE_BACKENDS):
            out = F.scaled_dot_product_attention(*args, scale=scale)
    else:
        out = F.scaled_dot_product_attention(*args, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def two_segment_dense_attention(q, k, v, cu_seqlens):
    """Attention for rows split in two segments [0, b) and [b, N) (b = cu_seqlens[1], read on the device)
    as ONE dense SDPA call: each row gets 8 extra head dims (q: its segment's one-hot; k: -C on the other
    segment's slot), so a cross-segment logit is offset by -C and its softmax weight is exactly 0, and
    same-segment logits are unchanged (the extra products are exact zeros). Head dims 72/80 run in the same
    kernel tile as 80/88, so the extra dims cost only the copies."""
    n, h, d = q.shape
    first = torch.arange(n, device=q.device) < cu_seqlens[1]  # [N] bool, no host sync
    pad = 8
    qp = q.new_zeros(n, h, d + pad)
    kp = k.new_zeros(n, h, d + pad)
    vp = v.new_zeros(n, h, d + pad)
    qp[..., :d] = q
    kp[..., :d] = k
    vp[..., :d] = v
    f = first[:, None].to(q.dtype)
    qp[..., d] = f
    qp[..., d + 1] = 1 - f
    kp[..., d] = (1 - f) * -_SEGMENT_PENALTY
    kp[..., d + 1] = f * -_SEGMENT_PENALTY
    return _dense_sdpa(qp, kp, vp, scale=d**-0.5)[..., :d]


def _cuda_attention(q, k, v, cu_seqlens, max_seqlen: int):
    n = q.shape[0]
    num_segments = cu_seqlens.shape[0] - 1
    if q.dtype in HALF_PRECISION:
        if max_seqlen >= n and num_segments == 1:
            return _dense_sdpa(q, k, v)
        if max_seqlen <= SHORT_SEGMENT_MAX and q.shape[-1] <= 128 and triton is not None:
            return short_segment_attention_triton(q, k, v, cu_seqlens, max_seqlen)
        if max_seqlen >= n and num_segments == 2:
            return two_segment_dense_attention(q, k, v, cu_seqlens)
        if _varlen_attn is not None:
            # v is a strided view of the fused qkv output; make it dense for the flash / cuDNN kernels
            # (no-op for q, k, which the rotary already rewrote). Positional arguments: keyword names
            # changed across torch versions; the default scale is head_dim ** -0.5, the towers' scale.
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return _masked_dense_attention(q, k, v, cu_seqlens)



# ---- Triton: attention over short segments (Qwen2.5 windows) ------------------------------------

if triton is not None:

    @triton.jit
    def _short_segment_attn_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, scale,
        s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_on, s_oh,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program per (segment, head): the whole segment (<= BLOCK_M rows) in one tile. Rows of a longer
        # segment past BLOCK_M are not computed (only a graph's dummy padding segment may be longer).
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


def short_segment_attention_triton(q, k, v, cu_seqlens, max_seqlen: int):
    """Attention within segments of at most `max_seqlen` (<= 128) rows; q, k, v [N, H, D] -> [N, H, D]."""
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
