"""What a client sends and gets back: an image or a video as sent, the server's answer per image or video,
the rows of a chunk. Shared by the clients (client/base.py) and their transports (client/http.py,
client/grpc_transport.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from encoder_service import errors
from encoder_service.protocol import image_info, video_info
from encoder_service.ranges import Segment


@dataclass(frozen=True)
class ImageSource:
    """One image as sent: exactly one of `data` (encoded file bytes) or `url`."""

    data: bytes | None = None
    url: str | None = None
    caller_id: str | None = None


@dataclass(frozen=True)
class VideoSource:
    """One video as sent: exactly one of `data` (a container file's bytes: MP4, MOV, MKV, WebM), `frames` (each
    an image file's bytes, in order) or `url`; the options are transformers' video processor's (None: the
    checkpoint's), `frames_fps` the rate of `frames` (None: unknown)."""

    data: bytes | None = None
    frames: tuple[bytes, ...] | None = None
    url: str | None = None
    caller_id: str | None = None
    fps: float | None = None
    num_frames: int | None = None
    sample_frames: bool | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    frames_fps: float | None = None

    OPTIONS = ("fps", "num_frames", "sample_frames", "min_pixels", "max_pixels", "frames_fps")

    def __post_init__(self):
        """Each option's type (the wire's: a finite double, an int64, a bool): a wrong one is InvalidInput here,
        on every transport, rather than a TypeError from a message builder. The server checks the values."""
        for name, value in self.options().items():
            kind = _OPTION_KINDS.get(name, "an integer")
            if kind == "true or false":
                ok = isinstance(value, bool)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                ok = False
            elif kind == "a finite number":
                ok = math.isfinite(value)
            else:
                ok = isinstance(value, int) and -2**63 <= value < 2**63
            if not ok:
                raise errors.InvalidInput(f"video option {name}={value!r}: expected {kind}")

    def options(self) -> dict:
        """The options that are set, by name."""
        return {name: getattr(self, name) for name in self.OPTIONS if getattr(self, name) is not None}


_OPTION_KINDS = {"fps": "a finite number", "frames_fps": "a finite number", "sample_frames": "true or false"}


@dataclass(frozen=True)
class VideoInfo(video_info.VideoInfo):
    """The server's answer for one video (protocol/video_info.py), and its rows when asked."""

    embedding: torch.Tensor | None = field(default=None, repr=False)  # with return_embeddings


@dataclass(frozen=True)
class ImageInfo(image_info.ImageInfo):
    """The server's answer for one image (protocol/image_info.py), and its rows when asked."""

    embedding: torch.Tensor | None = field(default=None, repr=False)  # with return_embeddings


@dataclass(frozen=True)
class FetchedRows:
    """Rows of one chunk [start, end). `rows` is the caller's `out` (rows at position - start) when one
    was given, else the packed [sum of segment rows, row_width] tensor in segment order."""

    start: int
    end: int
    segments: list[Segment]
    rows: torch.Tensor | None
    dtype: str | None = None
    layout: str | None = None
