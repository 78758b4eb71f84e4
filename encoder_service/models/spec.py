"""What the rest of the service needs to know about a loaded vision tower.

Row layout (the unit of everything downstream: cache entries, range fetch, the wire):
every merged token is one row of `row_width` values.
  - Qwen2-VL / Qwen2.5-VL: row = main embedding, width `out_hidden_size`.
  - Qwen3-VL (and MoE):    row = [main | deepstack_1 | ... | deepstack_L], each `out_hidden_size`
                           wide, so `row_width = out_hidden_size * (1 + L)`. Deepstack level k is
                           the merger output after vision block `deepstack_visual_indexes[k-1]`;
                           the LLM adds it to the hidden states after decoder layer k-1.
Rows of one image are in placeholder order (the order the LLM's image tokens appear).
A range of token rows is therefore one contiguous byte range of the row-major entry.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class VisionSpec:
    family: str  # one of FAMILIES
    model_type: str  # as found in config.json, e.g. "qwen3_vl_moe"
    patch_size: int  # 14 (Qwen2/2.5) or 16 (Qwen3)
    temporal_patch_size: int  # 2
    merge_size: int  # 2: a merged token covers merge x merge patches
    in_channels: int  # 3
    out_hidden_size: int  # LLM hidden size: width of the main embedding
    num_deepstack: int  # 0, or len(deepstack_visual_indexes) for Qwen3

    @property
    def row_width(self) -> int:
        return self.out_hidden_size * (1 + self.num_deepstack)

    @property
    def layout(self) -> str:
        """Names the row layout on the wire and in cache headers."""
        if self.num_deepstack == 0:
            return "main"
        return "main+deepstack" + str(self.num_deepstack)

    @property
    def patch_dim(self) -> int:
        """Width of one row of pixel_values: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this (28 or 32)."""
        return self.patch_size * self.merge_size


def num_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Merged tokens (LLM placeholders) for one image of patch grid (t, h, w)."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)
