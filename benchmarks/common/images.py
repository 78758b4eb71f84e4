"""Photo-like test images: gradients + noise, as JPEGs whose bytes (and so cache keys) differ per index."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """[height, width, 3] uint8, photo-like (gradients + noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 6.28, 3)
    base = np.stack([127 + 100 * np.sin(x / (37 + 13 * c) + y / (53 + 7 * c) + phase[c]) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def jpeg(width: int, height: int, seed: int, comment: str = "") -> bytes:
    """A photo-like JPEG. `comment` changes the bytes (and so the cache key), not the pixels."""
    buf = io.BytesIO()
    Image.fromarray(photo(width, height, seed), "RGB").save(buf, format="JPEG", quality=92, comment=comment.encode())
    return buf.getvalue()


def distinct_jpeg(base: np.ndarray, index: int) -> bytes:
    """`base` shifted by an index-dependent offset with the index stamped in as 32 8x8 blocks: distinct pixels
    (and bytes) per index, the same size and photo-like statistics for all."""
    h, w = base.shape[:2]
    img = np.roll(base, shift=((17 * (index // w)) % h, index % w), axis=(0, 1))
    for bit in range(32):
        img[:8, 8 * bit:8 * bit + 8] = 255 if (index >> bit) & 1 else 0
    buf = io.BytesIO()
    Image.fromarray(img, "RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def stamped(jpeg_bytes: bytes, stamp: str) -> bytes:
    """`jpeg_bytes` with `stamp` in a comment segment (COM) right after the start-of-image marker: other bytes
    (another cache key), the same pixels and decode work."""
    if jpeg_bytes[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG (no start-of-image marker)")
    text = stamp.encode()
    return jpeg_bytes[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + jpeg_bytes[2:]


def make_jpegs(size: tuple[int, int], indices, seed: int = 0) -> list[bytes]:
    """distinct_jpeg of one photo of `size` for each index, made on a few threads."""
    base = photo(*size, seed=seed)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda i: distinct_jpeg(base, i), indices))
