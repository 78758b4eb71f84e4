"""Images made in memory for the tests: random-noise pictures, PNGs whose header claims any size, and new
bytes for the same pixels."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """An RGB picture of uniform random pixels (the same for the same seed)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_bytes(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """`noise_image` encoded as `fmt` (PNG, JPEG, ...)."""
    buf = io.BytesIO()
    noise_image(width, height, seed).save(buf, format=fmt)
    return buf.getvalue()


def truncated_jpeg(seed: int) -> bytes:
    """A 120x120 JPEG cut short: its header reads fine (encode answers, sized), its decode fails later, on a
    CPU thread in the engine."""
    jpeg = image_bytes(120, 120, seed, "JPEG")
    return jpeg[:len(jpeg) // 2 - 7]


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk: length, type, payload, CRC."""
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A real, small PNG whose header claims width x height (8-bit RGB); its pixel data is never read."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", rows) + png_chunk(b"IEND", b"")


def png_with_text(png: bytes, n: int) -> bytes:
    """`png`'s pixels under other bytes: a tEXt chunk naming `n` after the signature (8 bytes) and IHDR (25).
    A new cache key per `n` without encoding another PNG."""
    return png[:33] + png_chunk(b"tEXt", b"n\x00" + str(n).encode()) + png[33:]


def data_url(png: bytes) -> str:
    """A PNG's bytes as a data: URL (the image_url a chat request carries)."""
    return "data:image/png;base64," + base64.b64encode(png).decode()
