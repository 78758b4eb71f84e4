"""Layers shared by the Qwen-VL vision towers.

Module and parameter names follow the checkpoints (`attn.qkv`, `patch_embed.proj`, `merger.ln_q`, ...), so
a checkpoint key minus its `visual.` prefix is a parameter name. The one stored differently is the patch
embedding (see `PatchEmbed`). Shapes: N = patches in the batch, E = tower width, H = heads, D = E // H.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder_service.models.metadata import BatchMetadata, build_batch_metadata
from encoder_service.runtime.attention import varlen_attention


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# `hidden_act` values of the vision configs (transformers' ACT2FN names).
ACTIVATIONS = {"quick_gelu": quick_gelu, "silu": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu}


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride == kernel, held as one Linear: each row of pixel_values is one
    (C, T, P, P) patch, so the conv is exactly `pixels @ W.T` with W = conv weight reshaped to
    [E, C*T*P*P]. The loader does that reshape (`conv_weight_to_linear`)."""

    def __init__(self, patch_dim: int, embed_dim: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(patch_dim, embed_dim, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))  # [N, patch_dim] -> [N, E]


def conv_weight_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """[E, C, T, P, P] Conv3d weight -> [E, C*T*P*P] Linear weight (row order of pixel_values)."""
    return weight.reshape(weight.shape[0], -1)


class RMSNorm(nn.Module):
    """Qwen2.5's RMSNorm: normalise in float32, cast back, and only then multiply by the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k [N, H, D] rotated in float32 then cast back; cos, sin [N, D] float32."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + rotate_half(q32) * sin
    k_out = k32 * cos + rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


class VisionAttention(nn.Module):
    """Fused-qkv multi-head attention over packed segments (one kernel call for all images/windows)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, H, D]
        q, k = apply_rotary(q, k, cos, sin)
        out = varlen_attention(q, k, v, cu_seqlens, max_seqlen)  # [N, H, D]
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    """Pre-norm transformer block; the family picks the norms and the MLP."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


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
    """What the towers share: `metadata(grid_thw)` (CPU, cached per shape) and the checkpoint layout."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def metadata(self, grid_thw: list[tuple[int, int, int]]) -> BatchMetadata:
        return build_batch_metadata(
            grid_thw, merge=self.config.merge_size, head_dim=self.config.head_dim, rope_theta=self.config.rope_theta
        )

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name (no `visual.` prefix) -> shape as stored in a checkpoint."""
        c = self.config
        shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        conv_shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        shapes["patch_embed.proj.weight"] = conv_shape
        return shapes
