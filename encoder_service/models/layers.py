"""Layers shared by the Qwen-VL vision towers.

Module and parameter names follow the checkpoints (`attn.qkv`, `patch_embed.proj`, `merger.ln_q`, ...), so
a checkpoint key minus its `visual.` prefix is a parameter name, except where a module's
`checkpoint_layout()` says otherwise (models/checkpoint_layout.py): the patch embedding and the MLPs.
The compute goes through ops/: each op's torch reference (the towers' eager order, as transformers) on the
CPU and in float32, its fused kernel on CUDA in half precision (ops/fast_path.py).
Shapes: N = patches in the batch, E = tower width, H = heads, D = E // H, I = the padded MLP width.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from encoder_service.models.checkpoint_layout import Stored
from encoder_service.models.metadata import BatchMetadata, build_batch_metadata
from encoder_service.ops.activation import ACTIVATIONS, gated_linear_act, linear_act
from encoder_service.ops.attention import varlen_attention
from encoder_service.ops.norm import add_projection, pre_norm, rms_norm
from encoder_service.ops.rotary import rotate_qkv


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride == kernel, held as one Linear: each row of pixel_values is one
    (C, T, P, P) patch, so the conv is exactly `pixels @ W.T` with W = the conv weight viewed [E, C*T*P*P]."""

    def __init__(self, config, bias: bool):
        super().__init__()
        c = config
        self.patch_shape = (c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Linear(math.prod(self.patch_shape), c.hidden_size, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))  # [N, patch_dim] -> [N, E]

    def checkpoint_layout(self) -> dict[str, Stored]:
        conv = (self.proj.out_features, *self.patch_shape)  # [E, C, T, P, P]
        return {"proj.weight": Stored(conv, "proj.weight", lambda w: w.view(conv))}


class RMSNorm(nn.Module):
    """Qwen2.5's RMSNorm (ops/norm.py: rms_norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def with_residual(self, x: torch.Tensor, proj_bias: torch.Tensor):
        """(norm(x), residual) that start a block's sub-layer (ops/norm.py: pre_norm)."""
        return pre_norm(x, self.weight, None, self.eps, rms=True, proj_bias=proj_bias)


class LayerNorm(nn.LayerNorm):
    """The towers' LayerNorm (Qwen2, Qwen3): eps 1e-6, and `with_residual` for a block's sub-layer."""

    def __init__(self, dim: int):
        super().__init__(dim, eps=1e-6)

    def with_residual(self, x: torch.Tensor, proj_bias: torch.Tensor):
        """(norm(x), residual) that start a block's sub-layer (ops/norm.py: pre_norm)."""
        return pre_norm(x, self.weight, self.bias, self.eps, rms=False, proj_bias=proj_bias)


class VisionAttention(nn.Module):
    """Multi-head attention with one fused qkv projection, over packed segments (one kernel call for all
    images / windows). `attend` stops before the output projection `proj`: the block adds that to the
    residual (ops/norm.py: add_projection)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def attend(self, x, cos, sin, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """[N, E] -> [N, E]: rotary on q and k, attention within the segments of cu_seqlens."""
        q, k, v = rotate_qkv(self.qkv(x), cos, sin, self.num_heads)  # each [N, H, D]
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen).reshape(x.shape[0], -1)


class GatedMLP(nn.Module):
    """Qwen2.5: down(act(gate(x)) * up(x)) at the padded width I (models/configs.py: MLP_PAD_MULTIPLE), gate
    and up in one weight `gate_up_proj` [2 * I, E], gate rows first. `hidden` stops before `down_proj`: the
    block adds that to the residual."""

    def __init__(self, config):
        super().__init__()
        e, p = config.hidden_size, config.intermediate_size_padded
        self.width = config.intermediate_size  # as stored
        self.gate_up_proj = nn.Linear(e, 2 * p)
        self.down_proj = nn.Linear(p, e)
        self.act = ACTIVATIONS[config.hidden_act]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return gated_linear_act(x, self.gate_up_proj.weight, self.gate_up_proj.bias, self.act)  # [N, I]

    def checkpoint_layout(self) -> dict[str, Stored]:
        e, i, p = self.down_proj.out_features, self.width, self.down_proj.in_features
        return {
            "gate_proj.weight": Stored((i, e), "gate_up_proj.weight", lambda w: w[:i]),
            "gate_proj.bias": Stored((i,), "gate_up_proj.bias", lambda b: b[:i]),
            "up_proj.weight": Stored((i, e), "gate_up_proj.weight", lambda w: w[p : p + i]),
            "up_proj.bias": Stored((i,), "gate_up_proj.bias", lambda b: b[p : p + i]),
            "down_proj.weight": Stored((e, i), "down_proj.weight", lambda w: w[:, :i]),
        }


class PlainMLP(nn.Module):
    """down(act(up(x))) at the padded width I: Qwen2-VL (quick_gelu; stored as fc1 / fc2) and Qwen3-VL
    (tanh GELU; stored as linear_fc1 / linear_fc2). `hidden` stops before `down_proj`."""

    def __init__(self, config, stored_names: tuple[str, str]):
        super().__init__()
        e, p = config.hidden_size, config.intermediate_size_padded
        self.width = config.intermediate_size  # as stored
        self.stored_names = stored_names
        self.up_proj = nn.Linear(e, p)
        self.down_proj = nn.Linear(p, e)
        self.act = ACTIVATIONS[config.hidden_act]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return linear_act(x, self.up_proj.weight, self.up_proj.bias, self.act)  # [N, I]

    def checkpoint_layout(self) -> dict[str, Stored]:
        e, i = self.down_proj.out_features, self.width
        up, down = self.stored_names
        return {
            f"{up}.weight": Stored((i, e), "up_proj.weight", lambda w: w[:i]),
            f"{up}.bias": Stored((i,), "up_proj.bias", lambda b: b[:i]),
            f"{down}.weight": Stored((e, i), "down_proj.weight", lambda w: w[:, :i]),
            f"{down}.bias": Stored((e,), "down_proj.bias"),
        }


class VisionBlock(nn.Module):
    """Pre-norm transformer block; the family picks the norm (RMSNorm or LayerNorm) and the MLP."""

    def __init__(self, config, norm: type[RMSNorm] | type[LayerNorm], mlp: GatedMLP | PlainMLP):
        super().__init__()
        self.norm1, self.norm2 = norm(config.hidden_size), norm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = mlp

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        # x + proj(attention(norm1(x))), then x + down(mlp(norm2(x))); ops/norm.py has the two op orders
        # (reference: the eager order; CUDA half precision: bias in the residual, residual in the GEMM).
        attn, mlp = self.attn, self.mlp
        h, r = self.norm1.with_residual(x, attn.proj.bias)
        x = add_projection(r, attn.attend(h, cos, sin, cu_seqlens, max_seqlen), attn.proj.weight, attn.proj.bias)
        h, r = self.norm2.with_residual(x, mlp.down_proj.bias)
        return add_projection(r, mlp.hidden(h), mlp.down_proj.weight, mlp.down_proj.bias)


class PatchMerger(nn.Module):
    """Qwen2/2.5 merger: norm each patch, concatenate the merge x merge patches of a merged token (they are
    consecutive rows), then Linear -> exact GELU -> Linear. [N, E] -> [N / merge^2, out]."""

    def __init__(self, dim: int, out_dim: int, merge_size: int, norm: nn.Module):
        super().__init__()
        self.unit_dim = dim * merge_size**2
        self.ln_q = norm
        self.mlp = nn.Sequential(nn.Linear(self.unit_dim, self.unit_dim), nn.GELU(), nn.Linear(self.unit_dim, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.unit_dim))


class VisionTower(nn.Module):
    """What the towers share: the config and `metadata(grid_thw)` (CPU, cached per shape)."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def metadata(self, grid_thw: list[tuple[int, int, int]]) -> BatchMetadata:
        return build_batch_metadata(
            grid_thw, merge=self.config.merge_size, head_dim=self.config.head_dim, rope_theta=self.config.rope_theta
        )
