"""The towers' 2D rotary position embedding, applied to q and k straight out of the fused qkv projection.

q and k are rotated in float32 and rounded back once (transformers' order): x * cos + rotate_half(x) * sin,
cos / sin [N, D] float32 from the batch metadata (models/metadata.py: rotary_cos_sin). The reference takes
~20 eager kernels over [N, H, D]; the fast path is one Triton kernel that reads qkv once.
Shapes: qkv [N, 3 * H * D]; q, k, v [N, H, D].
"""

from __future__ import annotations

import torch

from encoder_service.ops.fast_path import fast_path, tl, triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k [N, H, D] rotated in float32 then cast back; cos, sin [N, D] float32 (the reference)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + rotate_half(q32) * sin
    k_out = k32 * cos + rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int):
    """(q, k, v) of the fused projection's output, q and k rotated; v is a view into qkv."""
    view = qkv.view(qkv.shape[0], 3, num_heads, -1)
    v = view[:, 2]
    if fast_path(qkv):
        return (*rotary_qk_triton(qkv, cos, sin, num_heads), v)
    return (*apply_rotary(view[:, 0], view[:, 1], cos, sin), v)


# ---- Triton (CUDA, half precision) ----------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rotary_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, N,
        s_qkv_n, s_qkv_which, s_qkv_h,  # strides of qkv viewed [N, 3, H, D] (last dim contiguous)
        s_out_n, s_out_h,  # strides of q/k out [N, H, D] (last dim contiguous)
        H: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        # q_out = q * cos + rotate_half(q) * sin in float32, rounded once; same for k. cos/sin [N, 2*HALF] f32.
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (rows[:, None] < N) & (cols[None, :] < HALF)
        rows64 = rows.to(tl.int64)[:, None]
        D = 2 * HALF
        cs = rows64 * D + cols[None, :]
        cos1 = tl.load(cos_ptr + cs, mask=mask, other=1.0)
        cos2 = tl.load(cos_ptr + cs + HALF, mask=mask, other=1.0)
        sin1 = tl.load(sin_ptr + cs, mask=mask, other=0.0)
        sin2 = tl.load(sin_ptr + cs + HALF, mask=mask, other=0.0)
        for h in tl.static_range(H):
            src = qkv_ptr + rows64 * s_qkv_n + h * s_qkv_h + cols[None, :]
            dst = rows64 * s_out_n + h * s_out_h + cols[None, :]
            # q
            x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + dst, (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(q_ptr + dst + HALF, (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty), mask=mask)
            # k
            x1 = tl.load(src + s_qkv_which, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + s_qkv_which + HALF, mask=mask, other=0.0).to(tl.float32)
            tl.store(k_ptr + dst, (x1 * cos1 - x2 * sin1).to(k_ptr.dtype.element_ty), mask=mask)
            tl.store(k_ptr + dst + HALF, (x2 * cos2 + x1 * sin2).to(k_ptr.dtype.element_ty), mask=mask)


def rotary_qk_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int):
    """qkv [N, 3 * H * D] (last dim contiguous) -> rotated q, k [N, H, D], new contiguous tensors."""
    n = qkv.shape[0]
    view = qkv.view(n, 3, num_heads, -1)
    d = view.shape[-1]
    q_out = torch.empty(n, num_heads, d, device=qkv.device, dtype=qkv.dtype)
    k_out = torch.empty_like(q_out)
    assert view.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and cos.shape == (n, d)
    block_n = 16
    if n:
        _rotary_kernel[(triton.cdiv(n, block_n),)](
            view, cos, sin, q_out, k_out, n,
            view.stride(0), view.stride(1), view.stride(2), q_out.stride(0), q_out.stride(1),
            H=num_heads, HALF=d // 2, BLOCK_N=block_n, BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=4,
        )
    return q_out, k_out
