"""What a client sends and gets back: an image or a video as sent, the server's answer per image or video,
the rows of a chunk. Shared by the clients (client/base.py) and their transports (client/http.py,
client/grpc_transport.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encoder_service.protocol import image_info, video_info
from encoder_service.protocol.video_request import VideoRequest
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
