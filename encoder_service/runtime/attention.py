"""The one attention entry point of the towers: non-causal attention over packed variable-length segments.

`varlen_attention(q, k, v, cu_seqlens, max_seqlen)`: q, k, v `[N, heads, head_dim]`; segment i is rows
`cu_seqlens[i]:cu_seqlens[i+1]` (int32, `[num_segments + 1]`, zero-length segments allowed); tokens attend
only within their segment. Returns `[N, heads, head_dim]`.

Backends, picked from the tensors' device:
  - CUDA (bf16/fp16), chosen from Python ints only (shapes and max_seqlen; capturable, no host sync;
    see `_cuda_attention` and benchmarks/RESULTS.md for the measurements behind it):
      * one segment spanning all rows: dense SDPA `[1, H, N, D]` (cuDNN; 1.4x varlen_attn);
      * max_seqlen <= 64 (Qwen2.5 windows): a Triton kernel, one tile per (segment, head);
      * two segments with max_seqlen >= N (one image plus the graph's dummy padding segment): one dense
        SDPA with the segment mask folded into extra head dims (exactly 0 weight across segments);
      * otherwise `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, flash).
    Not used: cuDNN's ragged kernel (`aten._cudnn_attention_forward` with cum_seq offsets): captured in a
    CUDA graph on torch 2.11 it left the CUDA RNG in a state where every later random op raised "Offset
    increment outside graph capture encountered unexpectedly".
  - CUDA without it: dense SDPA under a block-diagonal mask built on the device (no host sync; memory
    O(N^2), a correctness fallback only).
  - CPU: one SDPA call per segment, boundaries read on the host (a CPU tensor: no device sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


# ---- CUDA dispatch (runtime fast path) -----------------------------------------------------------

# Segments this short go to the Triton tile kernel (runtime/kernels.py) instead of varlen_attn.
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
    if q.dtype in (torch.float16, torch.bfloat16):
        if max_seqlen >= n and num_segments == 1:
            return _dense_sdpa(q, k, v)
        if max_seqlen <= SHORT_SEGMENT_MAX and q.shape[-1] <= 128:
            kernels = _kernels()
            if kernels is not None:
                return kernels.short_segment_attention(q, k, v, cu_seqlens, max_seqlen)
        if max_seqlen >= n and num_segments == 2:
            return two_segment_dense_attention(q, k, v, cu_seqlens)
        if _varlen_attn is not None:
            # v is a strided view of the fused qkv output; make it dense for the flash / cuDNN kernels
            # (no-op for q, k, which the rotary already rewrote). Positional arguments: keyword names
            # changed across torch versions; the default scale is head_dim ** -0.5, the towers' scale.
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return _masked_dense_attention(q, k, v, cu_seqlens)


def _kernels():
    try:
        from encoder_service.runtime import kernels
    except ImportError:  # no Triton
        return None
    return kernels
