"""What the core takes and answers. The transports build the inputs from their requests and turn the
results into their answers (protocol/ has the payloads and messages both ends share, and `ImageInfo`,
the per-image encode answer; `FetchResult.header()` is a fetch's wire header for both transports)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encoder_service.protocol.image_info import ImageInfo
from encoder_service.protocol.wire import WireHeader
from encoder_service.ranges import Segment


@dataclass(frozen=True)
class ImageInput:  # exactly one of data / url
    data: bytes | None = None
    url: str | None = None
    caller_id: str | None = None  # optional caller-supplied id (own namespace, "u:<id>")


@dataclass
class EncodeResult:
    images: list[ImageInfo]
    embeddings: list[torch.Tensor] | None = None  # per image [num_tokens, row_width], CPU, when asked
    timings: dict[str, float] = field(default_factory=dict)  # ms


@dataclass(frozen=True)
class FetchItem:
    id: str
    offset: int  # the image's first placeholder position in the prompt


@dataclass
class FetchResult:
    segments: list[Segment]  # placeholder order; rows of segment k follow those of segment k-1
    rows: torch.Tensor | None  # [sum rows, row_width], CPU, contiguous; None when written to shared memory
    dtype: str
    row_width: int
    layout: str
    timings: dict[str, float] = field(default_factory=dict)  # ms
    shm_bytes: int | None = None  # bytes written into the caller's ShmTarget

    def header(self) -> WireHeader:
        """The wire header (protocol/wire.py) of this result: with rows, checked against the segments
        (`WireHeader.of`: a mismatch is a server bug, never sent); written to shared memory, from the fields."""
        if self.rows is not None:
            return WireHeader.of(self.segments, self.rows, self.layout)
        return WireHeader(self.dtype, self.row_width, self.layout, tuple(self.segments))
