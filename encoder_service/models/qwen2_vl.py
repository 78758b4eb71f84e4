"""Qwen2-VL vision tower: LayerNorm blocks with a quick_gelu MLP, 2D rotary, per-frame full attention,
and a LayerNorm patch merger. Output [num_tokens, out_hidden_size] in placeholder order."""

from __future__ import annotations

import torch
from torch import nn

from encoder_service.models.configs import Qwen2VLConfig
from encoder_service.models.layers import LayerNorm, PatchEmbed, PatchMerger, PlainMLP, VisionBlock, VisionTower
from encoder_service.models.metadata import BatchMetadata


class Qwen2VLTower(VisionTower):
    def __init__(self, config: Qwen2VLConfig):
        super().__init__(config)
        c = config
        self.patch_embed = PatchEmbed(c, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(c, LayerNorm, PlainMLP(c, stored_names=("fc1", "fc2"))) for _ in range(c.depth)
        )
        self.merger = PatchMerger(c.hidden_size, c.out_hidden_size, c.merge_size, LayerNorm(c.hidden_size))

    def forward(self, pixel_values: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        x = self.patch_embed(pixel_values)  # [N, E]
        for block in self.blocks:
            x = block(x, meta.cos, meta.sin, meta.cu_seqlens, meta.max_seqlen)
        return self.merger(x)  # [N / merge^2, out_hidden_size]
