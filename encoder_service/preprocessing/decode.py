"""Untrusted bytes -> Pillow image: header probe with limits, then decode to RGB as transformers does.

Nothing here touches Pillow's module state: `ImageFile.LOAD_TRUNCATED_IMAGES` stays False (a truncated file
is an error) and `Image.MAX_IMAGE_PIXELS` keeps its default. Our own pixel limit is checked from the header
right after `Image.open`, which reads only the header; Pillow's decompression-bomb check runs inside
`Image.open` first, so an image over Pillow's limit surfaces as its error, which we turn into ours.
Thread safety: each call works on its own Image object; Pillow releases the GIL while decoding, converting
and resizing, so calls on a thread pool run in parallel.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

from PIL import Image

from ..errors import EncoderServiceError, ImageDecodeError, LimitExceeded
from .limits import ImageLimits

# Restricting Image.open to these also keeps hostile input away from the other plugins (EPS, for one,
# would run Ghostscript). The JPEG opener also opens the multi-picture JPEGs phones write (format "MPO").
SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# Pillow's message: "Image size (N pixels) exceeds limit of M pixels, could be decompression bomb DOS attack."
_PILLOW_BOMB_MESSAGE = re.compile(r"\((\d+) pixels\) exceeds limit of (\d+) pixels")


@dataclass(frozen=True)
class ImageHeader:
    width: int
    height: int
    format: str  # Pillow's name: "JPEG", "PNG", ...
    mode: str  # Pillow's mode before conversion: "RGB", "RGBA", "P", "I;16", ...


def probe(data: bytes, limits: ImageLimits) -> ImageHeader:
    """Read and check the header only; no pixel is decoded."""
    with _open(data, limits) as image:
        return _header(image)


def decode_rgb(data: bytes, limits: ImageLimits) -> tuple[ImageHeader, Image.Image]:
    """Check the header, then decode the first frame and convert it to RGB."""
    # No `with`: closing would free the pixels that to_rgb may return as they are (an RGB image).
    image = _open(data, limits)
    header = _header(image)
    try:
        return header, to_rgb(image)
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ... on corrupt data
        raise ImageDecodeError(f"cannot decode the {header.format} image: {exc}") from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers 5.x `convert_to_rgb` (image_transforms.py) for a PIL image, which the PIL-backend processor
    applies to every input: an image with an alpha band or a `transparency` entry (RGBA, LA, PA, P or L or RGB
    with tRNS, GIF transparency) is composited over opaque white; every other mode (L, 1, P, CMYK, I;16, I, F,
    YCbCr, ...) goes through Pillow's `convert("RGB")`, which for I;16, I and F clips values to 0..255 rather
    than scaling them. transformers applies no EXIF orientation to a PIL image (only its `load_image`, for
    paths and URLs, does), so neither do we."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        image.load()  # convert("RGB") would only add a copy of the same pixels
        return image
    return image.convert("RGB")


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    limits.check_encoded_size(len(data))
    try:
        image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # The warning is an exception only where warnings are turned into errors.
        raise _pillow_bomb_limit(exc, limits) from None
    except Exception as exc:
        raise ImageDecodeError(
            f"not an image in a supported format ({', '.join(SUPPORTED_FORMATS)}): {len(data)} bytes"
        ) from exc
    try:
        width, height = image.size
        if width < 1 or height < 1:  # Pillow's plugins reject these today; smart_resize would divide by 0
            raise ImageDecodeError(f"the {image.format} image has zero size: {width}x{height}")
        limits.check_dimensions(width, height)
    except EncoderServiceError:
        image.close()
        raise
    return image


def _header(image: Image.Image) -> ImageHeader:
    width, height = image.size
    return ImageHeader(width=width, height=height, format=image.format, mode=image.mode)


def _pillow_bomb_limit(exc: Exception, limits: ImageLimits) -> LimitExceeded:
    found = _PILLOW_BOMB_MESSAGE.search(str(exc))
    if found is None:
        return LimitExceeded("decoded pixel count", f"over Pillow's limit ({exc})", limits.max_pixels)
    pixels, pillow_limit = int(found[1]), int(found[2])
    # Name our limit when the image breaks it; Pillow's only when ours was set above Pillow's.
    limit = limits.max_pixels if pixels > limits.max_pixels else pillow_limit
    return LimitExceeded("decoded pixel count", pixels, limit)
