"""Untrusted bytes -> Pillow image: header probe with limits, then decode to RGB as the engines load images.

As vLLM (`vllm/multimodal/image.py: normalize_image`, then its RGB conversion), transformers' `load_image` and
so the processor after them see a photo: its EXIF orientation applied (`ImageOps.exif_transpose`), unless the
caller turns that off (`exif_orientation=False`, `--no-exif-orientation`: pixels as stored), then transparency
composited over white. `probe` reads the orientation from the header too, so the size it answers is the
upright one (Orientation 5-8 swap width and height), without decoding pixels but for two rare kinds of file
(_orientation); `decode_rgb` applies the orientation `probe` reads, read the way `exif_transpose` reads it, so
the two always agree.

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
import struct
from dataclasses import dataclass

from PIL import ExifTags, Image

from ..errors import EncoderServiceError, ImageDecodeError, LimitExceeded
from .limits import ImageLimits

# Restricting Image.open to these also keeps hostile input away from the other plugins (EPS, for one,
# would run Ghostscript). The JPEG opener also opens the multi-picture JPEGs phones write (format "MPO").
SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# Pillow's message: "Image size (N pixels) exceeds limit of M pixels, could be decompression bomb DOS attack."
_PILLOW_BOMB_MESSAGE = re.compile(r"\((\d+) pixels\) exceeds limit of (\d+) pixels")


# ImageOps.exif_transpose's table: EXIF orientation -> the transpose that makes the stored pixels upright.
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# PNG chunks Pillow reads EXIF or XMP from (getexif: "exif", "Raw profile type exif", the XMP keys).
_PNG_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


@dataclass(frozen=True)
class ImageHeader:
    width: int  # as the processor gets the image: upright when its EXIF orientation is applied
    height: int
    format: str  # Pillow's name: "JPEG", "PNG", ...
    mode: str  # Pillow's mode before conversion: "RGB", "RGBA", "P", "I;16", ...
    orientation: int = 1  # the EXIF orientation decoding applies (1: none, the pixels as stored)

    @property
    def stored_size(self) -> tuple[int, int]:
        """(width, height) of the pixels as stored: orientations 5-8 turn the image by 90 degrees."""
        return (self.height, self.width) if self.orientation >= 5 else (self.width, self.height)


def probe(data: bytes, limits: ImageLimits, *, exif_orientation: bool = True) -> ImageHeader:
    """Read and check the header only; no pixel is decoded (but see _orientation: two rare kinds of file)."""
    with _open(data, limits) as image:
        return _header(image, data, exif_orientation)


def decode_rgb(data: bytes, limits: ImageLimits, *, exif_orientation: bool = True
               ) -> tuple[ImageHeader, Image.Image]:
    """Check the header, then decode the first frame, apply its EXIF orientation (unless `exif_orientation`
    is False) and convert it to RGB: the image of `probe`'s header."""
    header, image = open_image(data, limits, exif_orientation=exif_orientation)
    return header, upright_rgb(image, header)


def open_image(data: bytes, limits: ImageLimits, *, exif_orientation: bool = True
               ) -> tuple[ImageHeader, Image.Image]:
    """`probe`'s header (checked) and the image opened, its pixels not decoded yet: `upright_rgb` decodes
    them (or preprocessing/jpeg_into.py, into memory of the caller's)."""
    # No `with`: closing would free the pixels that to_rgb may return as they are (an RGB image).
    image = _open(data, limits)
    try:
        return _header(image, data, exif_orientation), image
    except EncoderServiceError:
        raise
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ... on corrupt data
        raise ImageDecodeError(f"cannot decode the {image.format} image: {exc}") from exc


def upright_rgb(image: Image.Image, header: ImageHeader) -> Image.Image:
    """The opened `image`'s first frame decoded, turned by `header.orientation` and converted to RGB."""
    try:
        if header.orientation in _UPRIGHT:
            image = image.transpose(_UPRIGHT[header.orientation])  # keeps info (transparency) and palette
        return to_rgb(image)
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ... on corrupt data
        raise ImageDecodeError(f"cannot decode the {image.format} image: {exc}") from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers 5.x `convert_to_rgb` (image_transforms.py) for a PIL image, which the PIL-backend processor
    applies to every input: an image with an alpha band or a `transparency` entry (RGBA, LA, PA, P or L or RGB
    with tRNS, GIF transparency) is composited over opaque white; every other mode (L, 1, P, CMYK, I;16, I, F,
    YCbCr, ...) goes through Pillow's `convert("RGB")`, which for I;16, I and F clips values to 0..255 rather
    than scaling them. vLLM's loader gives the same pixels: it pastes RGBA (and any other mode with
    transparency, converted to RGBA) onto white through the alpha band, equal to this composite for every
    colour and alpha, and leaves the rest to `convert("RGB")` or, for RGB with tRNS, to its processor's
    convert_to_rgb (this composite from transformers 5.23 on; the 5.19 of the vLLM CPU tier leaves it as it
    is). transformers' `load_image` differs: its `convert("RGB")` drops the alpha band without compositing."""
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
    except Image.UnidentifiedImageError as exc:  # no format of ours knows these bytes
        raise ImageDecodeError(
            f"not an image in a supported format ({', '.join(SUPPORTED_FORMATS)}): {len(data)} bytes"
        ) from exc
    except Exception as exc:  # a format knew them, then its header reader failed: Pillow's reason says why
        raise ImageDecodeError(f"cannot read the image's header ({len(data)} bytes): {exc}") from exc
    try:
        width, height = image.size
        if width < 1 or height < 1:  # Pillow's plugins reject these today; smart_resize would divide by 0
            raise ImageDecodeError(f"the {image.format} image has zero size: {width}x{height}")
        limits.check_dimensions(width, height)
    except EncoderServiceError:
        image.close()
        raise
    return image


def _header(image: Image.Image, data: bytes, exif_orientation: bool) -> ImageHeader:
    orientation = _orientation(image, data) if exif_orientation else 1
    width, height = image.size  # after _orientation, which may load the pixels (a TIFF may turn then)
    if orientation >= 5:
        width, height = height, width
    return ImageHeader(width=width, height=height, format=image.format, mode=image.mode, orientation=orientation)


def _orientation(image: Image.Image, data: bytes) -> int:
    """The EXIF orientation `ImageOps.exif_transpose` would apply (1: none), read as it reads it: `getexif()`
    after the pixels are loaded, Orientation from the EXIF, else from XMP. For JPEG, WebP, GIF and BMP loading
    changes nothing getexif reads, so the header is enough. Two kinds of image are decoded here, as
    exif_transpose would (both rare as photos): a PNG with chunks after its pixel data that Pillow reads EXIF
    or XMP from (only when it decodes the pixels), and a TIFF, whose orientation tag Pillow (13, at least) applies
    itself when it loads the pixels, whatever the setting, leaving nothing for exif_transpose.
    An EXIF Pillow cannot read means no orientation, as in vLLM (its normalize_image ignores the error and
    leaves the image as stored)."""
    if image.format == "TIFF" or image.format == "PNG" and _png_metadata_after_pixels(data):
        try:
            image.load()
        except Exception as exc:  # noqa: BLE001 - corrupt pixel data: decoding would fail the same way
            raise ImageDecodeError(f"cannot decode the {image.format} image: {exc}") from exc
    try:
        # The base class's getexif: PNG's own would load the pixels of every PNG without an eXIf chunk first.
        value = Image.Image.getexif(image).get(ExifTags.Base.Orientation)
        return int(value) if value in _UPRIGHT else 1  # exif_transpose's table lookup; 1 and junk: none
    except Exception:  # noqa: BLE001 - whatever a broken EXIF or XMP makes Pillow raise
        return 1


def _png_metadata_after_pixels(data: bytes) -> bool:
    """Whether a PNG has a chunk Pillow may read EXIF or XMP from after its first IDAT (image data) chunk.
    Walks the chunk headers only (bounded: each step moves 12 bytes or more)."""
    pos, after_pixels = 8, False  # after the signature
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IEND":
            return False
        after_pixels = after_pixels or kind == b"IDAT"
        if after_pixels and kind in _PNG_METADATA:
            return True
        pos += 12 + length  # length, type, data, CRC
    return False


def _pillow_bomb_limit(exc: Exception, limits: ImageLimits) -> LimitExceeded:
    found = _PILLOW_BOMB_MESSAGE.search(str(exc))
    if found is None:
        return LimitExceeded("decoded pixel count", f"over Pillow's limit ({exc})", limits.max_pixels)
    pixels, pillow_limit = int(found[1]), int(found[2])
    # Name our limit when the image breaks it; Pillow's only when ours was set above Pillow's.
    limit = limits.max_pixels if pixels > limits.max_pixels else pillow_limit
    return LimitExceeded("decoded pixel count", pixels, limit)
