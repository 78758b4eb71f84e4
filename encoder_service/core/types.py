"""What the core takes and answers. The transports build the inputs from their requests and turn the
results into their answers (protocol/ has the payloads and messages both ends share, and `ImageInfo`,
the per-image encode answer; `protocol/wire.py: WireHeader.of_fetch` is a fetch's wire header for both
transports)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encoder_service.protocol.image_info import ImageInfo
from encoder_service.protocol.video_info import VideoInfo
from encoder_service.protocol.video_request import VideoRequest
from encoder_service.ranges import Segment


@dataclass(frozen=True)
class ImageInput:  # exactly one of data / url
    data: bytes | None = None
    url: str | None = None
    caller_id: str | None = None  # optional caller-supplied id (own namespace, "u:<id>")


@dataclass(frozen=True)
class VideoInput(VideoRequest):
    """One video of an encode request, as a transport read it (protocol/video_request.py: its source, id and
    options; what the options mean: preprocessing/video.py, VideoOptions)."""


@dataclass
class EncodeResult:
    images: list[ImageInfo]
    embeddings: list[torch.Tensor] | None = None  # per image (or video) [num_tokens, row_width], CPU, when asked
    timings: dict[str, float] = field(default_factory=dict)  # ms
    videos: list[VideoInfo] = field(default_factory=list)  # a request of videos answers these (images empty)
    ipc: list | None = None  # with an IPC request: per image, protocol/ipc.py IpcPlacement or IpcUnavailable


@dataclass(frozen=True)
class FetchItem:
    id: str
    offset: int  # the image's first placeholder position in the prompt


@dataclass
class FetchResult:
    """A fetch's answer. No wire header here: the transports build it (protocol/wire.py: WireHeader.of_fetch)."""

    segments: list[Segment]  # placeholder order; rows of segment k follow those of segment k-1
    rows: torch.Tensor | None  # [sum rows, row_width], CPU, contiguous; None when written to shared memory
    dtype: str
    row_width: int
    layout: str
    timings: dict[str, float] = field(default_factory=dict)  # ms
    shm_bytes: int | None = None  # bytes written into the caller's ShmTarget
    ipc: object | None = None  # a fetch by IPC: protocol/ipc.py IpcPlacement or IpcUnavailable, instead of rows
