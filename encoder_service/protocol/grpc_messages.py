"""Conversions between encoder.v1 messages and wire headers / encode answers, shared by the gRPC server and
client."""

from __future__ import annotations

import torch

from encoder_service.protocol import wire
from encoder_service.protocol.image_info import ImageInfo
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.wire import RowWriter, WireError, WireHeader

# Trailing-metadata keys (see docs/interfaces.md, Wire format), besides the x-timing-* ones (timing.py).
ERROR_KIND = "error-kind"
RETRY_AFTER_S = "retry-after-s"


def header_to_proto(header: WireHeader) -> pb.FetchHeader:
    return pb.FetchHeader(
        version=header.version, dtype=header.dtype, row_width=header.row_width, layout=header.layout,
        num_rows=header.num_rows,
        segments=[pb.Segment(id=str(s.id), position=s.position, row_start=s.row_start, row_end=s.row_end)
                  for s in header.segments])


def header_from_proto(msg: pb.FetchHeader) -> WireHeader:
    # Through the dict form so gRPC headers get exactly the HTTP header's validation.
    return WireHeader.from_dict({
        "version": msg.version, "dtype": msg.dtype, "row_width": msg.row_width, "layout": msg.layout,
        "num_rows": msg.num_rows,
        "segments": [[s.id, s.position, s.row_start, s.row_end] for s in msg.segments]})


def info_to_proto(info: ImageInfo) -> pb.ImageInfo:
    """`info` (image_info.py: ImageInfo) as its message."""
    return pb.ImageInfo(**info.to_json())


def info_from_proto(msg: pb.ImageInfo, cls: type[ImageInfo] = ImageInfo, **extra) -> ImageInfo:
    """The message as a `cls` (ImageInfo or a subclass, whose own fields `extra` fills)."""
    return cls(id=msg.id, grid_thw=tuple(msg.grid_thw), num_tokens=msg.num_tokens, row_width=msg.row_width,
               hidden_size=msg.hidden_size, layout=msg.layout, dtype=msg.dtype, cached=msg.cached, **extra)


def embedding_from_bytes(info: pb.ImageInfo, data: bytes) -> torch.Tensor:
    """One image's [num_tokens, row_width] rows from EncodeResponse.embeddings."""
    return wire.rows_from_bytes(data, info.dtype, info.row_width, info.num_tokens)


class FetchAssembler:
    """Rebuilds a fetch payload from a Fetch stream: one header message, then data messages."""

    def __init__(self, out: torch.Tensor | None = None, start: int = 0):
        self._out, self._start, self._writer = out, start, None

    def add(self, msg: pb.FetchChunk) -> None:
        part = msg.WhichOneof("part")
        if part == "header":
            if self._writer is not None:
                raise WireError("Fetch stream carried a second header")
            self._writer = RowWriter(header_from_proto(msg.header), self._out, self._start)
        elif part == "data":
            if self._writer is None:
                raise WireError("Fetch stream sent row data before its header")
            self._writer.write(msg.data)
        else:
            raise WireError("Fetch stream sent an empty message")

    def finish(self) -> tuple[WireHeader, torch.Tensor]:
        if self._writer is None:
            raise WireError("Fetch stream ended without a header")
        return self._writer.header, self._writer.finish()


class ShmReply:
    """The answer to a Fetch with a ShmTarget: one header message (with shm_bytes) and nothing else."""

    def __init__(self):
        self._header: pb.FetchHeader | None = None

    def add(self, msg: pb.FetchChunk) -> None:
        if msg.WhichOneof("part") != "header" or self._header is not None:
            raise WireError("an shm Fetch stream carried more than its header: the server ignored the shm "
                            "target (does it predate shared-memory fetch?)")
        self._header = msg.header

    def finish(self) -> tuple[WireHeader, int]:
        if self._header is None:
            raise WireError("Fetch stream ended without a header")
        return header_from_proto(self._header), self._header.shm_bytes
