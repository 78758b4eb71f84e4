"""Triton kernels of the CUDA fast path. Imported only where Triton is present (runtime/fused.py decides);
every kernel here has a reference in torch that the CPU path runs instead (fused.py).

Shapes: N rows (patches), E tower width, H heads, D head dim, I MLP width. All kernels are launched with
grids computed from tensor shapes (Python ints), so they are capturable in a CUDA graph and never sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ---- norm (+ residual bias) -----------------------------------------------------------------------------------


@triton.jit
def _norm_residual_kernel(
    x_ptr, w_ptr, b_ptr, rb_ptr, out_ptr, res_ptr, E, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    # One row per program; x, out, res [N, E] contiguous. out = norm(x); res = x + res_bias (rounded to the
    # model dtype), the residual that the next GEMM adds its product to (beta = 1).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < E
    x = tl.load(x_ptr + row * E + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if IS_RMS:
        # Qwen2.5 RMSNorm: normalise in float32, cast to the model dtype, then multiply by the weight.
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / E + eps)
        y = (x32 * rstd).to(x_ptr.dtype.element_ty)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    else:
        mean = tl.sum(x32, axis=0) / E
        xc = tl.where(mask, x32 - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / E + eps)
        y = xc * rstd * w.to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * E + cols, y, mask=mask)
    if HAS_RES:
        rb = tl.load(rb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * E + cols, (x32 + rb).to(res_ptr.dtype.element_ty), mask=mask)


def norm_residual(x, weight, bias, eps: float, rms: bool, res_bias=None):
    """(x + res_bias, norm(x)); with res_bias None the first item is x itself."""
    x = x.contiguous()
    n, e = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if res_bias is not None else x
    if n:
        _norm_residual_kernel[(n,)](
            x, weight, bias if bias is not None else weight, res_bias if res_bias is not None else weight, out, res,
            e, eps, IS_RMS=rms, HAS_BIAS=bias is not None, HAS_RES=res_bias is not None,
            BLOCK=triton.next_power_of_2(e), num_warps=4 if e <= 2048 else 8,
        )
    return res, out


# ---- rotary -------------------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, N,
    s_qkv_n, s_qkv_which, s_qkv_h,  # strides of qkv viewed [N, 3, H, D] (last dim contiguous)
    s_out_n, s_out_h,  # strides of q/k out [N, H, DO] (last dim contiguous)
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


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, q_out=None, k_out=None):
    """qkv [N, 3*E] (the fused projection's output) -> rotated q, k [N, H, D] (or written into the given
    q_out / k_out views, last dim contiguous, e.g. the first D dims of a wider buffer)."""
    n = qkv.shape[0]
    view = qkv.view(n, 3, num_heads, -1)
    d = view.shape[-1]
    if q_out is None:
        q_out = torch.empty(n, num_heads, d, device=qkv.device, dtype=qkv.dtype)
        k_out = torch.empty_like(q_out)
    assert q_out.stride() == k_out.stride() and q_out.stride(-1) == 1 and view.stride(-1) == 1
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (n, d)
    block_n = 16
    if n:
        _rotary_kernel[(triton.cdiv(n, block_n),)](
            view, cos, sin, q_out, k_out, n,
            view.stride(0), view.stride(1), view.stride(2), q_out.stride(0), q_out.stride(1),
            H=num_heads, HALF=d // 2, BLOCK_N=block_n, BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=4,
        )
    return q_out, k_out


# ---- gated activation ---------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, I, BLOCK: tl.constexpr):
    # gu [N, 2*I]: gate | up. out [N, I] = silu(gate) * up, silu rounded to the model dtype first (as torch).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * I + cols, (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty(n, i, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up.contiguous(), out, n, i, BLOCK=block, num_warps=4)
    return out


# ---- attention over short segments (Qwen2.5 windows) --------------------------------------------


@triton.jit
def _short_segment_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_on, s_oh,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (segment, head): the whole segment (<= BLOCK_M rows) in one tile. Rows of a longer
    # segment past BLOCK_M are not computed (only the dummy padding segment may be longer; see attention.py).
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


def short_segment_attention(q, k, v, cu_seqlens, max_seqlen: int):
    """Attention within segments of at most `max_seqlen` (<= 128) rows; q, k, v [N, H, D]."""
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


# ---- Qwen3 learned position embedding -----------------------------------------------------------


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
    tl.store(out_ptr + row * E + cols, (x.to(tl.float32) + pos.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def pos_embed_add(x, table, pos_indices, pos_weights):
    n, e = x.shape
    out = torch.empty_like(x)
    if n:
        _pos_embed_add_kernel[(n,)](
            x.contiguous(), table.contiguous(), pos_indices.contiguous(), pos_weights.contiguous(), out, e,
            BLOCK=triton.next_power_of_2(e), num_warps=4,
        )
    return out
