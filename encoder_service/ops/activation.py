"""The MLPs' first GEMM and activation: [N, E] -> the hidden [N, I] that the down projection reads.

Gated (Qwen2.5): act(x @ Wg^T + bg) * (x @ Wu^T + bu), gate and up in one [2 * I, E] weight, gate rows
first. Plain (Qwen2 quick_gelu, Qwen3 tanh GELU): act(x @ W^T + b). Reference: the towers' eager order (the
GEMMs, then the activation, then the product). Fast path (CUDA, half precision; SiLU-gated, tanh GELU,
quick_gelu): ops/mlp_kernels.py's active policy picks the kernel (a GEMM with the activation in its
epilogue, or the GEMM then a separate activation), each checked against float32 before it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder_service.ops import mlp_kernels
from encoder_service.ops.fast_path import fast_path
from encoder_service.ops.mlp_kernels import gelu_tanh, quick_gelu

# `hidden_act` values of the vision configs (transformers' ACT2FN names). Each maps 0 to 0, which makes
# the zero-padded MLP width exact (models/configs.py: intermediate_size_padded).
ACTIVATIONS = {"quick_gelu": quick_gelu, "silu": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu}
# activation -> its mlp_kernels form, where the fast path has one
_GATED_FORMS = {F.silu: "swiglu"}
_PLAIN_FORMS = {gelu_tanh: "gelu_tanh", quick_gelu: "quick_gelu"}


def gated_linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up with gate | up = x @ weight^T + bias; weight [2 * I, E] gate rows first -> [N, I]."""
    if fast_path(x) and act in _GATED_FORMS:
        return mlp_kernels.run(_GATED_FORMS[act], x, weight, bias)
    i = weight.shape[0] // 2
    return act(F.linear(x, weight[:i], bias[:i])) * F.linear(x, weight[i:], bias[i:])


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act) -> torch.Tensor:
    """act(x @ weight^T + bias); weight [I, E] -> [N, I]."""
    if fast_path(x) and act in _PLAIN_FORMS:
        return mlp_kernels.run(_PLAIN_FORMS[act], x, weight, bias)
    return act(F.linear(x, weight, bias))
