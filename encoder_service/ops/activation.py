"""The MLPs' first GEMM and activation: [N, E] -> the hidden [N, I] that the down projection reads.

Gated (Qwen2.5): act(x @ Wg^T + bg) * (x @ Wu^T + bu), gate and up in one [2 * I, E] weight, gate rows
first. Reference: two GEMMs on the halves, then the activation and the product (the towers' eager order).
Fast path (SiLU): one GEMM for both, then one Triton kernel for silu(gate) * up.

Plain (Qwen2 quick_gelu, Qwen3 tanh GELU): act(x @ W^T + b). Fast path (tanh GELU): cuBLASLt's GELU
epilogue (the tanh approximation), bias and activation in the GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder_service.ops.fast_path import fast_path, tl, triton


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# `hidden_act` values of the vision configs (transformers' ACT2FN names). Each maps 0 to 0, which makes
# the zero-padded MLP width exact (models/configs.py: intermediate_size_padded).
ACTIVATIONS = {"quick_gelu": quick_gelu, "silu": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu}


def gated_linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up with gate | up = x @ weight^T + bias; weight [2 * I, E] gate rows first -> [N, I]."""
    if fast_path(x) and act is F.silu:
        return silu_mul_triton(F.linear(x, weight, bias))
    i = weight.shape[0] // 2
    return act(F.linear(x, weight[:i], bias[:i])) * F.linear(x, weight[i:], bias[i:])


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act) -> torch.Tensor:
    """act(x @ weight^T + bias); weight [I, E] -> [N, I]."""
    if fast_path(x) and act is gelu_tanh:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return act(F.linear(x, weight, bias))


# ---- Triton (CUDA, half precision) ----------------------------------------------------------------

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


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2 * I] (gate | up) -> silu(gate) * up [N, I]."""
    n, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty(n, i, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up.contiguous(), out, n, i, BLOCK=block, num_warps=4)
    return out
