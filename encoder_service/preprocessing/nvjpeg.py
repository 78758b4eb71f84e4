"""JPEG bytes -> RGB pixels on a CUDA device with nvJPEG (`torchvision.io.decode_jpeg(device=...)`).

The one optional use of torchvision: everything else of the torchvision backend is torch ops. When
torchvision cannot be imported, `NvJpegDecoder.load` says why (a warning) and returns None; images are then
decoded by Pillow, which the backend's fingerprint records.

nvJPEG is NOT bit-exact with Pillow's libjpeg-turbo (another IDCT and chroma upsampling; on A100 and later,
baseline JPEGs go to the hardware decoder): torchvision's own tests accept a mean absolute difference under
2 levels, and tests/gpu/test_preprocess_cuda.py checks that bound. transformers never decodes on the GPU
(it decodes a PIL image with Pillow), so the backend is equal to transformers given the pixels nvJPEG
decoded, not given the file. Hence opt-in, `--preprocess torchvision-nvjpeg`; the default `torchvision`
decodes every image with Pillow.

Only JPEGs that nvJPEG decodes like Pillow go to it: format "JPEG" (Pillow's "MPO", a phone's multi-picture
file, stays with Pillow, which reads its first picture) in mode RGB or L (nvJPEG has no CMYK/YCCK). Any
nvJPEG error, or a decoded size other than the header's, falls back to Pillow too. nvJPEG decodes the pixels
as stored; the header's EXIF orientation (decode.py) is then applied on the device (`upright`: flips and
transposes, the same pixel moves as Pillow's).
"""

from __future__ import annotations

import logging

import torch

from .decode import ImageHeader

log = logging.getLogger(__name__)

_MODES = ("RGB", "L")


class NvJpegDecoder:
    def __init__(self, device: torch.device, decode_jpeg, rgb_mode):
        self.device = device
        self._decode_jpeg, self._rgb = decode_jpeg, rgb_mode

    @classmethod
    def load(cls, device: torch.device) -> NvJpegDecoder | None:
        """A decoder for `device` (CUDA), or None when torchvision's image ops cannot be loaded."""
        try:
            from torchvision.io import ImageReadMode, decode_jpeg
        except Exception as exc:  # noqa: BLE001 - absent, or installed for another torch (see the Dockerfile)
            log.warning("torchvision is not importable (%s: %s): JPEGs are decoded by Pillow on the CPU, not by "
                        "nvJPEG", type(exc).__name__, exc)
            return None
        return cls(device, decode_jpeg, ImageReadMode.RGB)

    @staticmethod
    def accepts(header: ImageHeader) -> bool:
        return header.format == "JPEG" and header.mode in _MODES

    def decode(self, data: bytes, header: ImageHeader) -> torch.Tensor | None:
        """[3, H, W] uint8 RGB on the device, upright as `header` says, or None: decode this one with Pillow.
        Call `accepts` first.

        The output is allocated on the caller's current stream, which torchvision makes wait for the
        decoder's own stream (one decoder per process, behind a lock: calls from threads queue)."""
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a writable copy: torch wants one
        try:
            image = self._decode_jpeg(encoded, mode=self._rgb, device=self.device)
        except RuntimeError as exc:  # nvJPEG refused the bitstream (arithmetic coding, odd subsampling, ...)
            log.debug("nvJPEG could not decode a %dx%d JPEG (%s); decoding it with Pillow",
                      header.width, header.height, exc)
            return None
        width, height = header.stored_size
        if tuple(image.shape) != (3, height, width):
            log.debug("nvJPEG decoded %s for a %dx%d JPEG; decoding it with Pillow", tuple(image.shape), width, height)
            return None
        return upright(image, header.orientation)


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """[C, H, W] pixels as stored -> as EXIF `orientation` says to show them: ImageOps.exif_transpose's
    transpose for it (decode.py: _UPRIGHT), as tensor ops, contiguous."""
    if orientation in (5, 6, 7, 8):  # a quarter turn (and a flip): height and width swap
        image = image.transpose(1, 2)  # TRANSPOSE (5); then 6 = ROTATE_270, 7 = TRANSVERSE, 8 = ROTATE_90
    flips = {2: (2,), 3: (1, 2), 4: (1,), 6: (2,), 7: (1, 2), 8: (1,)}.get(orientation)
    return (image.flip(flips) if flips else image).contiguous()
