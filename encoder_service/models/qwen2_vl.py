"""Qwen2-VL vision tower: LayerNorm blocks with a quick_gelu MLP, 2D rotary, per-frame full attention,
and a LayerNorm patch merger. Output [num_tokens, out_hidden_size] in placeholder order."""

from __future__ import annotations

import torch
from torch import nn

from encoder_service.models.configs import Qwen2VLConfig
from encoder_service.models.layers import (
    ACTIVATIONS,
    PatchEmbed,
    PatchMerger,
    VisionAttention,
    VisionBlock,
    VisionTower,
)
from encoder_service.models.metadata import BatchMetadata


class Qwen2VLMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VLTower(VisionTower):
    def __init__(self, config: Qwen2VLConfig):
        super().__init__(config)
        c = config
        self.patch_embed = PatchEmbed(c.patch_dim, c.hidden_size, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(
                nn.LayerNorm(c.hidden_size, eps=1e-6),
                nn.LayerNorm(c.hidden_size, eps=1e-6),
                VisionAttention(c.hidden_size, c.num_heads),
                Qwen2VLMLP(c.hidden_size, c.mlp_hidden_size, c.hidden_act),
            )
            for _ in range(c.depth)
        )
        self.merger = PatchMerger(c.hidden_size, c.out_hidden_size, c.merge_size, nn.LayerNorm(c.hidden_size, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        x = self.patch_embed(pixel_values)  # [N, E]
        for block in self.blocks:
            x = block(x, meta.cos, meta.sin, meta.cu_seqlens, meta.max_seqlen)
        return self.merger(x)  # [N / merge^2, out_hidden_size]
