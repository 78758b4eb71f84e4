"""Encoded bytes -> pixel_values and grid_thw for the vision tower."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import PreprocessConfig
from .decode import decode_rgb
from .limits import ImageLimits
from .patchify import to_pixel_values
from .resize import plan, resize


@dataclass(frozen=True)
class PreprocessedImage:
    pixel_values: torch.Tensor  # [num_patches, C*T*P*P]; here float32 on the CPU (backends.py: any dtype, device)
    grid_thw: tuple[int, int, int]
    num_tokens: int


def preprocess(data: bytes, cfg: PreprocessConfig, limits: ImageLimits, *,
               exif_orientation: bool = True) -> PreprocessedImage:
    """Decode (with the EXIF orientation applied unless `exif_orientation` is False), resize, rescale, normalize
    and patchify one image, equal to transformers' Qwen2VLImageProcessorPil given the decoded, upright image.

    Raises LimitExceeded (before decoding) or ImageDecodeError. Safe to call from many threads at once.
    """
    header, rgb = decode_rgb(data, limits, exif_orientation=exif_orientation)
    image_plan = plan(header, cfg)
    resized = np.asarray(resize(rgb, image_plan))  # [H, W, 3] uint8
    pixel_values = torch.from_numpy(to_pixel_values(resized, cfg))
    return PreprocessedImage(pixel_values, image_plan.grid_thw, image_plan.num_tokens)
