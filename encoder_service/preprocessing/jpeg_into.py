"""A JPEG decoded by Pillow's own decoder straight into memory the caller owns (pinned, for the upload).

Pillow decodes a JPEG into storage of its own, and `np.array(image)` then copies it out byte by byte (RGB is
stored 4 bytes a pixel): at 1080p that copy is 3.2-3.4 ms on top of Pillow's 15 ms decode (RESULTS.md, "One
image's preprocessing step by step"). Here the same decoder, with the same settings, writes its rows into the
caller's [H, W, 4] uint8 array as RGBX: each pixel's three bytes as Pillow stores them, a fourth of padding.
So the pixels are Pillow's bit for bit (the decoder is the same; only where its rows land differs), checked
once per process against `Image.load()` (`usable`) and, across JPEG kinds, by tests/unit/test_jpeg_into.py.

Taken: a JPEG (or the first picture of an MPO) Pillow opens as RGB, in one tile, stored upright (the EXIF
orientation to apply is none). Everything else (grayscale, CMYK, a turned photo, other formats) returns
False, and so does a file this decode fails on (truncated, corrupt): the caller then decodes it the usual
way, which raises Pillow's own error for a bad file.

This reaches into Pillow below its public API (`Image._getdecoder`, `Image.core.map_buffer`, `tile`), the
calls `ImageFile.load` and `Image.frombuffer` make. Pillow releases the GIL while it decodes.
"""

from __future__ import annotations

import io
import logging
from functools import cache

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

# Pillow's mode for 4-byte pixels with a padding byte: its storage of RGB, and a mode `map_buffer` can place
# over memory of ours (Image.frombuffer's _MAPMODES).
_RGBX = "RGBX"


def takes(image: Image.Image, orientation: int) -> bool:
    """Whether `decode_into` can decode `image` (opened, not loaded), an image to be turned by EXIF
    `orientation` (1: none)."""
    if orientation != 1 or image.format not in ("JPEG", "MPO") or image.mode != "RGB" or len(image.tile) != 1:
        return False
    codec, extents, _offset, args = image.tile[0]
    return codec == "jpeg" and tuple(extents) == (0, 0, *image.size) and args[0] == "RGB" and usable()


def decode_into(image: Image.Image, data: bytes, out: np.ndarray) -> bool:
    """Decode `image` (opened from `data`, `takes` it) into `out`, [H, W, 4] uint8 C-contiguous: RGBX rows,
    the fourth byte padding. False (nothing to rely on in `out`) when the decoder fails or wants more bytes
    than `data` holds."""
    width, height = image.size
    if out.shape != (height, width, 4) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"decode_into: out must be [{height}, {width}, 4] uint8 contiguous, got {out.shape} "
                         f"{out.dtype}")
    _codec, extents, offset, args = image.tile[0]
    try:
        # ImageFile.load's calls, with the image's own decoder settings (decoderconfig: a draft's scale), into
        # an RGBX image whose storage is `out` (frombuffer's mapping: stride W * 4, top row first).
        target = Image.core.map_buffer(out, (width, height), "raw", 0, (_RGBX, 0, 1))
        decoder = Image._getdecoder(_RGBX, "jpeg", args, image.decoderconfig)
        decoder.setimage(target, tuple(extents))
        try:
            consumed, status = decoder.decode(memoryview(data)[offset:])
        finally:
            decoder.cleanup()
    except Exception as exc:  # noqa: BLE001 - a corrupt file, or a Pillow whose internals moved: the usual way
        log.debug("direct JPEG decode failed (%s: %s); decoding it the usual way", type(exc).__name__, exc)
        return False
    # (-1, 0): the image is complete. consumed >= 0: the decoder wants more (a truncated file); status < 0: an
    # error.
    return consumed < 0 and status >= 0


@cache
def usable() -> bool:
    """Once per process: this Pillow's direct decode of a small photo equals its `Image.load()`; if not (its
    internals changed), every JPEG is decoded the usual way, said once in the log."""
    try:
        data = _sample_jpeg()
        with Image.open(io.BytesIO(data)) as image:
            out = np.empty((image.height, image.width, 4), np.uint8)
            direct = decode_into(image, data, out)
        with Image.open(io.BytesIO(data)) as image:
            expected = np.asarray(image.convert("RGB"))
        ok = direct and np.array_equal(out[..., :3], expected)
    except Exception as exc:  # noqa: BLE001 - same: the usual way
        log.warning("direct JPEG decode unavailable with Pillow %s: %s", Image.__version__, exc)
        return False
    if not ok:
        log.warning("direct JPEG decode differs from Pillow %s's own; JPEGs are decoded the usual way",
                    Image.__version__)
    return ok


def _sample_jpeg() -> bytes:
    """A 67x45 photo-like JPEG with chroma subsampling (odd sizes: partial blocks at both edges)."""
    y, x = np.mgrid[0:45, 0:67]
    pixels = np.stack([x * 3, y * 5, (x * y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return buf.getvalue()
