"""torch's own attention paths for ops/attention.py's op: q, k, v `[N, heads, head_dim]` (v may be a strided
view), segments given by `cu_seqlens` (int32 `[num_segments + 1]`), out `[N, heads, head_dim]`.

  - `per_segment_attention`: one SDPA call per segment, reading the boundaries on the host: the CPU path
    (the towers' eager order) and, in float32, `reference_attention`, what every CUDA backend is checked
    against; never inside a graph.
  - `dense_sdpa`: all rows as one sequence (one segment).
  - `two_segment_dense_attention`: two segments as one dense call (an image + a graph's dummy rows).
  - `varlen_attention_torch`: torch's `varlen_attn` (torch >= 2.10; `varlen_attn` is None before).
  - `masked_dense_attention`: a block-diagonal mask over all rows: correct for any layout, O(N^2) memory;
    the last resort, and the path of CUDA in float32 / float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

# Cross-segment logit offset of the two-segment dense path: exp(-C * head_dim**-0.5) is exactly 0 in
# float32 for head_dim <= 256, and C is finite in float16 and bfloat16.
_SEGMENT_PENALTY = 30000.0


def per_segment_attention(q, k, v, cu_seqlens):
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()  # CPU op: a plain read; reference_attention on CUDA: a sync (checks only)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            # [L, H, D] -> [1, H, L, D]: 4-D like transformers' call, so the CPU kernel (and its bf16
            # rounding) is the same one.
            seg = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*seg)[0].transpose(0, 1)
    return out


def reference_attention(q, k, v, cu_seqlens) -> torch.Tensor:
    """The float32 reference on q's device: one float32 SDPA per segment (reads the boundaries on the host:
    checks and tests only, never inside a graph)."""
    return per_segment_attention(q.float(), k.float(), v.float(), cu_seqlens)


def masked_dense_attention(q, k, v, cu_seqlens):
    rows = torch.arange(q.shape[0], device=q.device, dtype=cu_seqlens.dtype)
    # Segment id of each row; zero-length segments repeat a boundary and own no rows.
    segment = torch.searchsorted(cu_seqlens, rows, right=True)
    mask = segment[:, None] == segment[None, :]  # [N, N] block diagonal
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), attn_mask=mask
    )
    return out.squeeze(0).transpose(0, 1)


def dense_sdpa(q, k, v, scale=None):
    """q, k, v [N, H, D*] -> [N, H, Dv] with SDPA over all rows as one sequence (torch's choice of kernel:
    cuDNN on the H100; benchmarks/attention/kernels.py compares them under sdpa_kernel)."""
    args = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*args, scale=scale).squeeze(0).transpose(0, 1)


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
    return dense_sdpa(qp, kp, vp, scale=d**-0.5)[..., :d]


def varlen_attention_torch(q, k, v, cu_seqlens, max_seqlen: int):
    # v is a strided view of the fused qkv output; make it dense for the flash kernel (a no-op for q, k,
    # which the rotary rewrote). Positional arguments: keyword names changed across torch versions; the
    # default scale is head_dim ** -0.5, the towers' scale.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
