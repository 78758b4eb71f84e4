"""What encode answers per image, on both ends: the HTTP JSON fields and the gRPC ImageInfo message."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageInfo:  # answered once the header is read and sized, before the ViT runs
    id: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    row_width: int
    hidden_size: int
    layout: str
    dtype: str
    cached: bool
