"""An encode's images, from the request to the engine's input:

  read     the bytes: inline, or GET from an allow-listed URL (urls.py)
  probe    on a CPU thread, before encode answers: the cache key (content hash of the bytes, or the
           caller's id, then with the bytes' content tag) and the size from the header alone (grid_thw,
           num_tokens; upright, as the backend will decode the image), no decode
  prepare  on a CPU thread, when the engine takes the image: full decode + resize + patchify, by the
           preprocessing backend (pil: on that thread; torchvision: on the model's device)
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
import torch
from PIL import Image

from encoder_service import errors, preprocessing
from encoder_service.cache import CacheKey, caller_key, content_tag, make_key
from encoder_service.core.types import ImageInput
from encoder_service.core.urls import UrlFetcher
from encoder_service.engine.engine import GridTHW


@dataclass(frozen=True)
class Probed:
    key: CacheKey
    grid_thw: GridTHW
    num_tokens: int
    data: Any  # what `reader.prepare` takes: an image's bytes (a video's frame group: core/videos.py, GroupJob)
    content_tag: int = 0  # of `data`, under a caller id (cache/keys.py: content_tag); 0 for a content key
    reader: Any = None  # engine/engine.py: Reader, the engine's prepare stage for `data`
    pixels: int = 0  # an image's width x height as decoded (its header's): what decoding it costs
    requester: Hashable | None = None  # who asked (engine/engine.py: Job.requester): one encode request, a video


class ImageReader:
    """`backend` preprocesses (its config and limits size and check the headers too); `model_fp` and
    `hash_algo` make the cache keys; `dtype` is the tower's (the backend casts pixel values to it);
    `pin_memory` when host pixel values go to a CUDA device."""

    def __init__(self, backend: preprocessing.Backend, urls: UrlFetcher, *,
                 model_fp: str, hash_algo: str, dtype: torch.dtype, pin_memory: bool):
        self.backend, self.urls = backend, urls
        self.cfg, self.limits = backend.cfg, backend.limits
        self._model_fp, self._hash = model_fp, hash_algo
        self._dtype, self._pin_memory = dtype, pin_memory

    async def read(self, index: int, img: ImageInput) -> bytes:
        if (img.data is None) == (img.url is None):
            raise errors.InvalidInput(f"image {index}: give exactly one of data or url")
        if img.url is not None:
            return await self.urls.fetch(img.url, index)
        if len(img.data) == 0:
            raise errors.ImageDecodeError(f"image {index}: empty image data (0 bytes)")
        return img.data

    def probe(self, index: int, data: bytes, caller_id: str | None, requester: Hashable | None = None) -> Probed:
        """CPU thread: content hash (or caller key) and header-only sizing of one image, for `requester`."""
        try:
            header = preprocessing.probe(data, self.limits, exif_orientation=self.backend.exif_orientation)
            plan = preprocessing.plan(header, self.cfg)
        except errors.EncoderServiceError as exc:
            raise exc.prefixed(f"image {index}: ") from None
        grid, num_tokens = tuple(int(x) for x in plan.grid_thw), int(plan.num_tokens)
        if caller_id is None:
            key, tag = make_key(data, self._model_fp, self._hash), 0
        else:
            key, tag = caller_key(caller_id, self._model_fp), content_tag(data)
        return Probed(key, grid, num_tokens, data, tag, self, header.width * header.height, requester)

    def prepare(self, data: bytes, grid_thw: GridTHW) -> torch.Tensor:
        """CPU thread (the engine's prepare stage): pixel values [num_patches, patch_dim] in the tower's dtype,
        of the grid encode answered from the header (`grid_thw`)."""
        pre = self.backend.preprocess(data, self._dtype)
        grid = tuple(int(x) for x in pre.grid_thw)
        if grid != tuple(grid_thw):
            raise errors.ImageDecodeError(f"decoded image has grid {grid}, its header promised {tuple(grid_thw)}")
        pixel_values = pre.pixel_values
        # Host pixel values (pil): pinned memory makes their copy to the GPU asynchronous on the GPU thread.
        # The torchvision backend on CUDA hands over a finished device tensor: nothing to copy.
        if self._pin_memory and pixel_values.device.type == "cpu":
            pixel_values = pixel_values.pin_memory()
        return pixel_values


def warmup_image(factor: int) -> bytes:
    """A small RGB JPEG (2x2 merged tokens' worth of pixels) for the readiness encode: a JPEG, so that it
    also starts nvJPEG where the preprocessing backend decodes with it."""
    side = 2 * factor
    img = Image.new("RGB", (side, side))
    img.putdata([((x * 7) % 256, (y * 13) % 256, ((x + y) * 5) % 256) for y in range(side) for x in range(side)])
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def warmup_photo() -> bytes:
    """A 1920x1080 photo-like JPEG (smooth gradients and grain, quality 90) for the start-up warm-up of every
    CPU thread (core/encoder.py: start)."""
    y, x = np.mgrid[0:1080, 0:1920]
    grain = np.random.default_rng(0).integers(-12, 13, (1080, 1920, 3))
    pixels = np.stack([x * 255 // 1919, y * 255 // 1079, (x + y) * 255 // 2998], axis=-1) + grain
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
