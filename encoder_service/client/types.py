"""What a client sends and gets back: an image or a video as sent, the server's answer per image or video,
the rows of a chunk. Shared by the clients (client/base.py) and their transports (client/http.py,
client/grpc_transport.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from encoder_service import errors
from encoder_service.protocol import image_info, video_info
from encoder_service.protocol.ipc import IpcPlacement, IpcUnavailable
from encoder_service.protocol.release import InvalidId, Released
from encoder_service.protocol.video_request import OPTIONS, VideoRequest
from encoder_service.ranges import Segment


@dataclass(frozen=True)
class ImageSource:
    """One image as sent: exactly one of `data` (encoded file bytes) or `url`."""

    data: bytes | None = None
    url: str | None = None
    caller_id: str | None = None


@dataclass(frozen=True)
class VideoSource(VideoRequest):
    """One video as sent (protocol/video_request.py: its source, id and options)."""

    def __post_init__(self):
        """Each option's type as the wire carries it (OPTIONS: a finite double, an int64, a bool): a wrong one is
        InvalidInput here, on every transport, rather than a TypeError from a message builder. The server
        checks the values."""
        for name, value in self.options().items():
            kind = OPTIONS[name]
            if kind is bool or isinstance(value, bool):
                ok = kind is bool and isinstance(value, bool)
            elif kind is float:
                ok = isinstance(value, (int, float)) and math.isfinite(value)
            else:
                ok = isinstance(value, int) and -2**63 <= value < 2**63
            if not ok:
                raise errors.InvalidInput(f"video option {name}={value!r}: expected {_KIND_NAMES[kind]}")


_KIND_NAMES = {float: "a finite number", int: "an integer", bool: "true or false"}


@dataclass(frozen=True)
class VideoInfo(video_info.VideoInfo):
    """The server's answer for one video (protocol/video_info.py), and its rows when asked."""

    embedding: torch.Tensor | None = field(default=None, repr=False)  # with return_embeddings


@dataclass(frozen=True)
class ImageInfo(image_info.ImageInfo):
    """The server's answer for one image (protocol/image_info.py), and its rows when asked."""

    embedding: torch.Tensor | None = field(default=None, repr=False)  # with return_embeddings
    # An encode asking for the rows by IPC: where they sit on the server's GPU (held), or why not (protocol/ipc.py).
    ipc: IpcPlacement | IpcUnavailable | None = field(default=None, repr=False)


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


class ReleaseCount(int):
    """What `release` answers: how many ids had a pin to drop (an int), and `invalid`: the malformed ids sent,
    each with why (protocol/release.py: InvalidId), which were not released while the others were."""

    invalid: tuple[InvalidId, ...]

    def __new__(cls, answer: Released) -> ReleaseCount:
        count = super().__new__(cls, answer.released)
        count.invalid = answer.invalid
        return count
