"""The preprocessing backends (`--preprocess`), behind one call: `backend.preprocess(data, dtype)`.

  pil                 transformers' `Qwen2VLImageProcessorPil`, bit for bit (pipeline.py), on the calling CPU
                      thread; pixel values on the CPU. The default off CUDA.
  torchvision         transformers' default `Qwen2VLImageProcessor` (torchvision), bit for bit on the same kind
                      of device (torch_ops.py), run on the model's device; every image decoded by Pillow on the
                      calling thread and copied up (an upright RGB JPEG by Pillow's decoder straight into pinned
                      host memory: jpeg_into.py): equal to transformers given a PIL image. The default on CUDA.
  torchvision-nvjpeg  the same with JPEGs decoded on the GPU by nvJPEG (nvjpeg.py), other images by Pillow:
                      less CPU per image, but nvJPEG's pixels are not Pillow's, so equal to transformers only
                      given the pixels nvJPEG decoded. Opt-in. (`torchvision-pil-decode`, the exact path's
                      name while nvJPEG was the default, is settings.PREPROCESS_ALIASES' deprecated alias.)

Both read the header and check the limits before any pixel is decoded (decode.py), and both apply a photo's
EXIF orientation as the engines' loaders do, unless `exif_orientation` is False (`--no-exif-orientation`). A
backend's `fingerprint` names what its values depend on; it is part of the cache key (cache/keys.py), so rows
made by one backend are never served for another (the orientation setting is in the key too, beside it).

On CUDA the torchvision backend runs on the calling thread's own stream (the engine's CPU pool: one stream
per thread, so images overlap each other and the ViT, which runs on the default stream), casts to the
tower's dtype there, and waits for that stream before returning: the engine's GPU thread gets a finished
device tensor and copies nothing. How many such tensors exist at once is bounded by the engine's queue
(engine/engine.py prepares every queued image as soon as a pool thread is free): up to --max-queue images
plus the batch on the GPU, about 25 MB each for a 1080p image in bf16.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from ..settings import PREPROCESS_BACKENDS
from . import jpeg_into, torch_ops
from .config import PreprocessConfig
from .decode import ImageHeader, open_image, probe, upright_rgb
from .limits import ImageLimits
from .nvjpeg import NvJpegDecoder
from .pipeline import PreprocessedImage, preprocess
from .resize import plan

log = logging.getLogger(__name__)
T = TypeVar("T")

# The largest decoded image (RGBX bytes) whose host copy is pinned: 32 MiB, 8 Mi pixels (4K UHD fits). Torch's
# pinned cache is the process's, one free list per power-of-two size, and keeps each block once used: a thread
# that met images of every size class up to this one holds about 64 MiB of it (8 threads: 512 MiB).
PINNED_PIXELS_MAX_BYTES = 32 << 20


class PilBackend:
    """`Qwen2VLImageProcessorPil` on the calling thread (pipeline.py)."""

    # Kept as the fingerprint every cache key had before there were backends (cache/keys.py leaves it out).
    fingerprint = "pil"

    def __init__(self, cfg: PreprocessConfig, limits: ImageLimits, *, exif_orientation: bool = True):
        self.cfg, self.limits, self.exif_orientation = cfg, limits, exif_orientation
        self.device = torch.device("cpu")

    def preprocess(self, data: bytes, dtype: torch.dtype = torch.float32) -> PreprocessedImage:
        """Pixel values on the CPU in `dtype` (float32: transformers' own output). Raises LimitExceeded
        (before decoding) or ImageDecodeError. Safe to call from many threads at once."""
        pre = preprocess(data, self.cfg, self.limits, exif_orientation=self.exif_orientation)
        # Cast on the CPU thread, not on the GPU: the patch embedding casts to the model dtype first thing,
        # and the cast rounds the same on either side, so bf16 halves the host-to-device bytes at no cost.
        return dataclasses.replace(pre, pixel_values=pre.pixel_values.to(dtype))


class TorchvisionBackend:
    """`Qwen2VLImageProcessor` as torch ops on `device`; `jpeg_decoder` (nvJPEG) decodes the JPEGs it accepts,
    Pillow everything else."""

    def __init__(self, cfg: PreprocessConfig, limits: ImageLimits, device: torch.device | str, *,
                 jpeg_decoder: NvJpegDecoder | None = None, exif_orientation: bool = True):
        self.cfg, self.limits, self.exif_orientation = cfg, limits, exif_orientation
        self.device = _indexed(torch.device(device))
        self._jpeg = jpeg_decoder
        self._streams = ThreadStreams(self.device)
        # torchvision resizes uint8 natively on the CPU and through float32 elsewhere (torch_ops.resize).
        resize = "uint8" if self.device.type == "cpu" else "float32"
        self.fingerprint = f"torchvision:resize={resize},decode={'nvjpeg' if jpeg_decoder else 'pil'}"

    def preprocess(self, data: bytes, dtype: torch.dtype = torch.float32) -> PreprocessedImage:
        """Pixel values on the backend's device in `dtype`, complete (on CUDA: this thread's stream waited
        for). Raises LimitExceeded (before decoding) or ImageDecodeError. Safe from many threads at once."""
        return self._streams.run(lambda: self._preprocess(data, dtype), lambda pre: pre.pixel_values)

    def _preprocess(self, data: bytes, dtype: torch.dtype) -> PreprocessedImage:
        header, image = self.decode(data)
        image_plan = plan(header, self.cfg)
        pixel_values = torch_ops.to_pixel_values(image, image_plan.resized_height, image_plan.resized_width,
                                                 self.cfg, dtype)
        return PreprocessedImage(pixel_values, image_plan.grid_thw, image_plan.num_tokens)

    def decode(self, data: bytes) -> tuple[ImageHeader, torch.Tensor]:
        """The header (limits checked first) and the RGB pixels, [3, H, W] uint8 contiguous on the device: what
        transformers' processor is given (the tests hand it the same tensor). On CUDA, call it on the stream
        the result is used on."""
        if self._jpeg is not None:
            header = probe(data, self.limits, exif_orientation=self.exif_orientation)
            if self._jpeg.accepts(header):
                image = self._jpeg.decode(data, header)
                if image is not None:
                    return header, image
        # Pillow, the EXIF orientation and transformers' convert_to_rgb (decode.py), then what transformers does
        # with a PIL image: np.array (a writable copy), from_numpy, permute to CHW, contiguous, to the device.
        # Here the upload comes first (the same bytes) and the CHW copy is made on the device. An upright RGB
        # JPEG skips the np.array copy: Pillow's decoder writes it into host memory of ours (jpeg_into.py),
        # pinned when it is small enough, so that the upload is one DMA.
        header, image = open_image(data, self.limits, exif_orientation=self.exif_orientation)
        if jpeg_into.takes(image, header.orientation):
            rgbx = _host_pixels(image.height, image.width, self.device)  # [H, W, 4] uint8
            if jpeg_into.decode_into(image, data, rgbx.numpy()):
                return header, rgbx.to(self.device, non_blocking=True)[..., :3].permute(2, 0, 1).contiguous()
        hwc = torch.from_numpy(np.array(upright_rgb(image, header)))  # [H, W, 3] uint8
        return header, hwc.to(self.device).permute(2, 0, 1).contiguous()


def _host_pixels(height: int, width: int, device: torch.device) -> torch.Tensor:
    """[height, width, 4] uint8 host memory for a decode bound for `device`: pinned (from torch's caching
    host allocator, which keeps each block until the copies queued from it are done) for a CUDA device, up to
    PINNED_PIXELS_MAX_BYTES; pageable otherwise."""
    nbytes = height * width * 4
    pinned = device.type == "cuda" and nbytes <= PINNED_PIXELS_MAX_BYTES
    return torch.empty((height, width, 4), dtype=torch.uint8, pin_memory=pinned)


Backend = PilBackend | TorchvisionBackend


class ThreadStreams:
    """Preprocessing on `device` from many CPU threads at once: on CUDA each calling thread queues its work on a
    stream of its own (so it overlaps the other threads' and the ViT's, on the default stream) and waits for
    it before handing the result over; elsewhere the work just runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()  # .stream: the calling thread's CUDA stream

    def run(self, work: Callable[[], T], tensor_of: Callable[[T], torch.Tensor]) -> T:
        """`work()`, complete; `tensor_of(result)` is the device tensor the caller hands on."""
        if self.device.type != "cuda":
            return work()
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            result = work()
            # The engine's GPU thread reads the tensor on the default stream; this keeps its memory from being
            # handed out on this stream again until the work queued there by the time it is freed is done.
            tensor_of(result).record_stream(torch.cuda.default_stream(self.device))
        stream.synchronize()  # the CPU thread waits (GIL released), never the GPU thread
        return result


def make_backend(name: str, cfg: PreprocessConfig, limits: ImageLimits, device: torch.device | str, *,
                 exif_orientation: bool = True) -> Backend:
    """The backend `--preprocess` names (settings.PREPROCESS_BACKENDS), for a model on `device`;
    `exif_orientation`: apply a photo's EXIF orientation (`--exif-orientation`)."""
    device = _indexed(torch.device(device))
    if name == "pil":
        backend = PilBackend(cfg, limits, exif_orientation=exif_orientation)
    elif name == "torchvision":
        backend = TorchvisionBackend(cfg, limits, device, exif_orientation=exif_orientation)
    elif name == "torchvision-nvjpeg":
        backend = TorchvisionBackend(cfg, limits, device, jpeg_decoder=_nvjpeg(device),
                                     exif_orientation=exif_orientation)
    else:
        raise ValueError(f"preprocess backend is {name!r}, expected one of {', '.join(PREPROCESS_BACKENDS)}")
    log.info("preprocessing: %s on %s, EXIF orientation %s", backend.fingerprint, backend.device,
             "applied" if exif_orientation else "ignored")
    return backend


def _nvjpeg(device: torch.device) -> NvJpegDecoder | None:
    """nvJPEG for `device`, or None (Pillow decodes, and the fingerprint says so) off CUDA or without torchvision."""
    if device.type != "cuda":
        log.warning("--preprocess torchvision-nvjpeg: nvJPEG decodes on CUDA only; the model is on %s, so JPEGs "
                    "are decoded by Pillow", device)
        return None
    return NvJpegDecoder.load(device)


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:N (the current device): streams and the decoder need the index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
