"""Pre-norm and the residual add of a block's sub-layer: RMSNorm (Qwen2.5) or LayerNorm (Qwen2, Qwen3).

A sub-layer is  x + proj(f(norm(x)))  (proj: the attention output projection or the MLP down projection,
each with a bias). `pre_norm` starts it and `add_projection` ends it; two op orders, per `fast_path`:

  reference (the towers' eager order, as transformers):
      n = norm(x);  r = x                      pre_norm
      out = r + (h @ W^T + b)                  add_projection: two roundings in the model dtype
  fast (CUDA, half precision):
      n, r = norm(x), x + b                    pre_norm: one Triton kernel, reads x once
      out = r.addmm_(h, W^T)                   add_projection: the residual rides in the GEMM epilogue
                                               (beta 1), in place on r, bias already in it

Both functions pick their path from tensors of one device and dtype, so the bias is added exactly once.
Shapes: x, n, r, out [N, E]; h [N, K]; W [E, K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder_service.ops.fast_path import fast_path, tl, triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2.5's RMSNorm: normalise in float32, cast back, and only then multiply by the weight (the casts
    of transformers; bfloat16 results equal its bit for bit)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def pre_norm(x, weight, bias, eps: float, *, rms: bool, proj_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), r): the sub-layer's input and the residual to hand to `add_projection` with the closing
    projection (whose bias is `proj_bias`). RMSNorm if `rms` (bias None), else LayerNorm."""
    if fast_path(x):
        return norm_residual_triton(x, weight, bias, eps, rms, proj_bias)
    normed = rms_norm(x, weight, eps) if rms else F.layer_norm(x, weight.shape, weight, bias, eps)
    return normed, x


def add_projection(residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """residual + h @ weight^T + bias, `residual` being pre_norm's (on the fast path it holds the bias and
    is overwritten: out-of-place addmm would first copy it into a new output)."""
    if fast_path(residual):
        return residual.addmm_(h, weight.t())
    return residual + F.linear(h, weight, bias)


# ---- Triton (CUDA, half precision) ----------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _norm_residual_kernel(
        x_ptr, w_ptr, b_ptr, pb_ptr, out_ptr, res_ptr, E, eps, IS_RMS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # One row per program; x, out, res [N, E] contiguous. out = norm(x); res = x + proj bias (rounded to
        # the model dtype), the residual that the closing GEMM adds its product to (beta = 1).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < E
        x = tl.load(x_ptr + row * E + cols, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        if IS_RMS:
            # As rms_norm: normalise in float32, cast to the model dtype, then multiply by the weight.
            rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / E + eps)
            y = (x32 * rstd).to(x_ptr.dtype.element_ty)
            y = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
        else:
            mean = tl.sum(x32, axis=0) / E
            xc = tl.where(mask, x32 - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / E + eps)
            y = xc * rstd * w.to(tl.float32) + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * E + cols, y, mask=mask)
        pb = tl.load(pb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * E + cols, (x32 + pb).to(res_ptr.dtype.element_ty), mask=mask)


def norm_residual_triton(x, weight, bias, eps: float, rms: bool, proj_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), x + proj_bias) in one pass over x [N, E]; LayerNorm needs its bias, RMSNorm has none."""
    assert (bias is None) == rms, "RMSNorm has no bias; LayerNorm has one"
    x = x.contiguous()
    n, e = x.shape
    normed, residual = torch.empty_like(x), torch.empty_like(x)
    if n:
        _norm_residual_kernel[(n,)](
            x, weight, weight if bias is None else bias, proj_bias, normed, residual, e, eps,
            IS_RMS=rms, BLOCK=triton.next_power_of_2(e), num_warps=4 if e <= 2048 else 8,
        )
    return normed, residual
