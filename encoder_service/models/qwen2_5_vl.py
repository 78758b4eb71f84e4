"""Qwen2.5-VL vision tower: RMSNorm blocks with a gated SiLU MLP, 2D rotary, window attention except in
`fullatt_block_indexes` (per-frame full attention there), RMSNorm patch merger.

The blocks run in window order: merged-token units are gathered by `meta.window_index` after the patch
embedding, and the merged output is put back in placeholder order with `meta.reverse_index`.
Output [num_tokens, out_hidden_size].
"""

from __future__ import annotations

import torch
from torch import nn

from encoder_service.models.configs import Qwen2_5VLConfig
from encoder_service.models.layers import GatedMLP, PatchEmbed, PatchMerger, RMSNorm, VisionBlock, VisionTower
from encoder_service.models.metadata import BatchMetadata, build_batch_metadata, gather_units


class Qwen2_5VLTower(VisionTower):
    def __init__(self, config: Qwen2_5VLConfig):
        super().__init__(config)
        c = config
        self.patch_embed = PatchEmbed(c, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(c, RMSNorm, GatedMLP(c)) for _ in range(c.depth))
        self.merger = PatchMerger(c.hidden_size, c.out_hidden_size, c.merge_size, RMSNorm(c.hidden_size))
        self.full_attention_blocks = frozenset(c.fullatt_block_indexes)

    def metadata(self, grid_thw: list[tuple[int, int, int]]) -> BatchMetadata:
        c = self.config
        return build_batch_metadata(
            grid_thw, merge=c.merge_size, head_dim=c.head_dim, rope_theta=c.rope_theta, window_units=c.window_units
        )

    def forward(self, pixel_values: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        x = self.patch_embed(pixel_values)  # [N, E], placeholder order
        x = gather_units(x, meta.window_index, meta.merge_unit)  # window order
        for i, block in enumerate(self.blocks):
            if i in self.full_attention_blocks:
                x = block(x, meta.cos, meta.sin, meta.cu_seqlens, meta.max_seqlen)
            else:
                x = block(x, meta.cos, meta.sin, meta.cu_window_seqlens, meta.max_window_seqlen)
        return self.merger(x)[meta.reverse_index]  # [N / merge^2, out_hidden_size], placeholder order
