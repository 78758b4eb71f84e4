"""Bounds on what one untrusted image may cost, checked before any pixel is decoded."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LimitExceeded

# smart_resize (transformers) rejects anything longer than this; a looser limit here could not be served.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int  # encoded size
    max_pixels: int  # decoded width * height, read from the header
    max_aspect_ratio: float = MAX_ASPECT_RATIO  # long side / short side

    def __post_init__(self):
        if self.max_image_bytes < 1 or self.max_pixels < 1:
            raise ValueError(f"limits must be positive: {self}")
        if not 1 <= self.max_aspect_ratio <= MAX_ASPECT_RATIO:
            raise ValueError(f"max_aspect_ratio must be in [1, {MAX_ASPECT_RATIO}], got {self.max_aspect_ratio}")

    def check_encoded_size(self, num_bytes: int) -> None:
        if num_bytes > self.max_image_bytes:
            raise LimitExceeded("encoded image size in bytes", num_bytes, self.max_image_bytes)

    def check_dimensions(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise LimitExceeded(f"decoded pixel count of the {width}x{height} image", width * height, self.max_pixels)
        check_aspect_ratio(width, height, self.max_aspect_ratio)


def check_aspect_ratio(width: int, height: int, limit: float) -> None:
    ratio = max(width, height) / min(width, height)
    if ratio > limit:
        raise LimitExceeded(f"aspect ratio (long side / short side) of the {width}x{height} image", ratio, limit)
