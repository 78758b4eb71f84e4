"""Target size of an image (from its header alone) and the resize itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image

from ..models.spec import num_tokens
from .config import PreprocessConfig
from .decode import ImageHeader
from .limits import MAX_ASPECT_RATIO, check_aspect_ratio


@dataclass(frozen=True)
class ImagePlan:
    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]  # patch grid: (1 frame, rows, columns)
    num_tokens: int  # merged tokens: LLM placeholders for this image


def plan(header: ImageHeader, cfg: PreprocessConfig) -> ImagePlan:
    """Everything `encode` answers with, known before decoding."""
    height, width = smart_resize(header.height, header.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    grid_thw = (1, height // cfg.patch_size, width // cfg.patch_size)
    return ImagePlan(height, width, grid_thw, num_tokens(grid_thw, cfg.merge_size))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `smart_resize` (qwen2_vl), step for step: sides rounded to multiples of `factor`, then
    scaled into [min_pixels, max_pixels] keeping the aspect ratio. Its ValueError for an aspect ratio over
    200 is our LimitExceeded."""
    check_aspect_ratio(width, height, MAX_ASPECT_RATIO)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize(image: Image.Image, image_plan: ImagePlan) -> Image.Image:
    """The call transformers' PIL backend makes (image_transforms.resize): bicubic, no reducing_gap. It makes
    it even when the size is unchanged, which returns an identical copy, so skipping that is exact."""
    size = (image_plan.resized_width, image_plan.resized_height)
    if image.size == size:
        return image
    return image.resize(size, resample=Image.Resampling.BICUBIC, reducing_gap=None)
