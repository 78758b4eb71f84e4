"""Qwen3-VL vision tower (also Qwen3-VL-MoE's): LayerNorm blocks with a tanh-GELU MLP, a learned position
table bilinearly resampled to each image's grid, 2D rotary, per-frame full attention, and deepstack:
extra mergers applied after the blocks in `deepstack_visual_indexes`.

Output rows [num_tokens, out_hidden_size * (1 + L)] = [main | deepstack_1 | ... | deepstack_L], main being
the final merger's output and deepstack_k the k-th deepstack merger's (block order, as transformers), each
out_hidden_size wide, placeholder order (spec.py: the row layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder_service.models.configs import Qwen3VLConfig
from encoder_service.models.layers import LayerNorm, PatchEmbed, PlainMLP, VisionBlock, VisionTower
from encoder_service.models.metadata import BatchMetadata, build_batch_metadata
from encoder_service.ops.pos_embed import add_position_embedding


class Qwen3VLMerger(nn.Module):
    """LayerNorm, concat merge^2 patches, Linear -> exact GELU -> Linear: [N, E] -> [N / merge^2, out].
    The main merger normalises each patch (width E); deepstack mergers normalise the concatenation."""

    def __init__(self, dim: int, out_dim: int, merge_size: int, norm_after_concat: bool):
        super().__init__()
        self.unit_dim = dim * merge_size**2
        self.norm_after_concat = norm_after_concat
        self.norm = LayerNorm(self.unit_dim if norm_after_concat else dim)
        self.linear_fc1 = nn.Linear(self.unit_dim, self.unit_dim)
        self.linear_fc2 = nn.Linear(self.unit_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.unit_dim)) if self.norm_after_concat else self.norm(x).view(-1, self.unit_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLTower(VisionTower):
    def __init__(self, config: Qwen3VLConfig):
        super().__init__(config)
        c = config
        self.patch_embed = PatchEmbed(c, bias=True)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(
            VisionBlock(c, LayerNorm, PlainMLP(c, stored_names=("linear_fc1", "linear_fc2"))) for _ in range(c.depth)
        )
        self.merger = Qwen3VLMerger(c.hidden_size, c.out_hidden_size, c.merge_size, norm_after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLMerger(c.hidden_size, c.out_hidden_size, c.merge_size, norm_after_concat=True)
            for _ in c.deepstack_visual_indexes
        )
        # block index -> its deepstack merger
        self.deepstack_after_block = {block: k for k, block in enumerate(c.deepstack_visual_indexes)}

    def metadata(self, grid_thw: list[tuple[int, int, int]]) -> BatchMetadata:
        c = self.config
        return build_batch_metadata(
            grid_thw, merge=c.merge_size, head_dim=c.head_dim, rope_theta=c.rope_theta, pos_embed_side=c.pos_embed_side
        )

    def forward(self, pixel_values: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        x = self.patch_embed(pixel_values)  # [N, E]
        x = add_position_embedding(x, self.pos_embed.weight, meta.pos_indices, meta.pos_weights)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, meta.cos, meta.sin, meta.cu_seqlens, meta.max_seqlen)
            if i in self.deepstack_after_block:
                deepstack.append(self.deepstack_merger_list[self.deepstack_after_block[i]](x))
        return torch.cat([self.merger(x), *deepstack], dim=1)  # [N / merge^2, out * (1 + L)]
