"""The MLPs' first GEMM and activation: [N, E] -> the hidden [N, I] that the down projection reads.

Gated (Qwen2.5): act(x @ Wg^T + bg) * (x @ Wu^T + bu), gate and up in one [2 * I, E] weight, gate rows
first. Reference: two GEMMs on the halves, then the activation and the product (the towers' eager order).
Fast path (SiLU): ops/mlp_kernels.py's active policy picks the kernel (one GEMM for both then a Triton
silu_mul, or a GEMM with the SwiGLU in its epilogue), each checked against float32 before it runs.

Plain (Qwen2 quick_gelu, Qwen3 tanh GELU): act(x @ W^T + b). Fast path (tanh GELU): cuBLASLt's GELU
epilogue (the tanh approximation), bias and activation in the GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder_service.ops import mlp_kernels
from encoder_service.ops.fast_path import fast_path


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
        return mlp_kernels.gated_silu(x, weight, bias)
    i = weight.shape[0] // 2
    return act(F.linear(x, weight[:i], bias[:i])) * F.linear(x, weight[i:], bias[i:])


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act) -> torch.Tensor:
    """act(x @ weight^T + bias); weight [I, E] -> [N, I]."""
    if fast_path(x) and act is gelu_tanh:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return act(F.linear(x, weight, bias))
