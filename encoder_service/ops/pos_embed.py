"""Qwen3's learned position embedding: each patch adds 4 bilinear taps of a [side^2, E] table.

x [N, E] (the patch embedding), table [side^2, E], indices [N, 4] int64 rows of the table, weights [N, 4]
float32 (models/metadata.py: position_interpolation). The taps are weighted and summed in float32, rounded
to the model dtype, then added (transformers' order). Reference: ~6 eager kernels over [N, 4, E] float32;
fast path: one Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder_service.ops.fast_path import fast_path, tl, triton


def add_position_embedding(x, table, indices, weights) -> torch.Tensor:
    if fast_path(x):
        return pos_embed_add_triton(x, table, indices, weights)
    pos = (F.embedding(indices, table) * weights[:, :, None]).sum(1)  # [N, E] float32
    return x + pos.to(x.dtype)


# ---- Triton (CUDA, half precision) ----------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _pos_embed_add_kernel(x_ptr, table_ptr, idx_ptr, w_ptr, out_ptr, E, BLOCK: tl.constexpr):
        # out[n] = x[n] + round(sum_j w[n, j] * table[idx[n, j]]) with the taps summed in float32.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < E
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(4):
            idx = tl.load(idx_ptr + row * 4 + j).to(tl.int64)
            w = tl.load(w_ptr + row * 4 + j)
            acc += w * tl.load(table_ptr + idx * E + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * E + cols, mask=mask, other=0.0)
        pos = acc.to(x_ptr.dtype.element_ty)
        out = (x.to(tl.float32) + pos.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * E + cols, out, mask=mask)


def pos_embed_add_triton(x, table, indices, weights) -> torch.Tensor:
    n, e = x.shape
    out = torch.empty_like(x)
    if n:
        _pos_embed_add_kernel[(n,)](
            x.contiguous(), table.contiguous(), indices.contiguous(), weights.contiguous(), out, e,
            BLOCK=triton.next_power_of_2(e), num_warps=4,
        )
    return out
