"""Conversions between encoder.v1 messages and wire headers / encode answers (images and videos) / release
answers, shared by the gRPC server and client."""

from __future__ import annotations

from typing import Callable

import torch

from encoder_service.protocol import wire
from encoder_service.protocol.image_info import ImageInfo
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.release import InvalidId, Released
from encoder_service.protocol.video_info import VideoInfo
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
    return pb.ImageInfo(**{k: v for k, v in info.to_json().items() if v is not None})


def info_from_proto(msg: pb.ImageInfo, cls: type[ImageInfo] = ImageInfo, **extra) -> ImageInfo:
    """The message as a `cls` (ImageInfo or a subclass, whose own fields `extra` fills)."""
    return cls(id=msg.id, grid_thw=tuple(msg.grid_thw), num_tokens=msg.num_tokens, row_width=msg.row_width,
               hidden_size=msg.hidden_size, layout=msg.layout, dtype=msg.dtype, cached=msg.cached,
               owner=msg.owner or None, **extra)


def video_info_to_proto(info: VideoInfo) -> pb.VideoInfo:
    """`info` (video_info.py: VideoInfo) as its message (group_timestamps None: empty)."""
    return pb.VideoInfo(**{k: v for k, v in info.to_json().items() if v is not None})


def video_info_from_proto(msg: pb.VideoInfo, cls: type[VideoInfo] = VideoInfo, **extra) -> VideoInfo:
    """The message as a `cls` (VideoInfo or a subclass, whose own fields `extra` fills)."""
    return cls(id=msg.id, video_grid_thw=tuple(msg.video_grid_thw), num_tokens=msg.num_tokens,
               tokens_per_group=msg.tokens_per_group, num_frames=msg.num_frames, sampled_fps=msg.sampled_fps,
               second_per_grid_t=msg.second_per_grid_t if msg.HasField("second_per_grid_t") else None,
               group_timestamps=tuple(msg.group_timestamps) or None, row_width=msg.row_width,
               hidden_size=msg.hidden_size, layout=msg.layout, dtype=msg.dtype, cached=msg.cached,
               owner=msg.owner or None, **extra)


def release_to_proto(answer: Released) -> pb.ReleaseResponse:
    return pb.ReleaseResponse(released=answer.released,
                              invalid=[pb.InvalidId(id=i.id, reason=i.reason) for i in answer.invalid])


def release_from_proto(msg: pb.ReleaseResponse) -> Released:
    return Released(msg.released, tuple(InvalidId(i.id, i.reason) for i in msg.invalid))


def serialize_fetch_chunk(message: pb.FetchChunk | bytes) -> bytes:
    """Fetch's response serializer: data messages come framed already (wire.grpc_data_message)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def embedding_from_bytes(info: pb.ImageInfo | pb.VideoInfo, data: bytes) -> torch.Tensor:
    """One image's (or video's) [num_tokens, row_width] rows from EncodeResponse.embeddings."""
    return wire.rows_from_bytes(data, info.dtype, info.row_width, info.num_tokens)


class FetchAssembler:
    """Rebuilds a fetch payload from a Fetch stream's serialized messages (the client reads them raw): one
    header, then data messages, whose bytes go from the message straight into `writer_for(header)`'s
    buffer (wire.grpc_data_view: no protobuf copy). A header with a pickup ticket ends the stream: the rows
    wait on the HTTP port (`pickup` then holds (token, port)) and go into `writer` from there."""

    def __init__(self, writer_for: Callable[[WireHeader], RowWriter]):
        self._writer_for = writer_for
        self.writer: RowWriter | None = None
        self.pickup: tuple[str, int] | None = None

    def add(self, message: bytes) -> None:
        data = wire.grpc_data_view(message)
        if data is None:
            msg = pb.FetchChunk.FromString(message)
            part = msg.WhichOneof("part")
            if part == "header":
                self._header(msg.header)
                return
            if part != "data":
                raise WireError("Fetch stream sent an empty message")
            data = msg.data
        if self.writer is None:
            raise WireError("Fetch stream sent row data before its header")
        if self.pickup is not None:
            raise WireError("Fetch stream sent row data after a pickup ticket")
        self.writer.write(data)

    def _header(self, msg: pb.FetchHeader) -> None:
        if self.writer is not None:
            raise WireError("Fetch stream carried a second header")
        self.writer = self._writer_for(header_from_proto(msg))  # checks the caller's buffer before any row
        if msg.pickup_token:
            self.pickup = (msg.pickup_token, msg.pickup_port)

    def finish(self) -> WireHeader:
        """The header, once the stream ended (the caller finishes the writer: rows in place, checked)."""
        if self.writer is None:
            raise WireError("Fetch stream ended without a header")
        return self.writer.header


class ShmReply:
    """The answer to a Fetch with a ShmTarget: one header message (with shm_bytes) and nothing else."""

    def __init__(self):
        self._header: pb.FetchHeader | None = None

    def add(self, message: bytes) -> None:
        msg = pb.FetchChunk.FromString(message)
        if msg.WhichOneof("part") != "header" or self._header is not None:
            raise WireError("an shm Fetch stream carried more than its header: the server ignored the shm "
                            "target (does it predate shared-memory fetch?)")
        self._header = msg.header

    def finish(self) -> tuple[WireHeader, int]:
        if self._header is None:
            raise WireError("Fetch stream ended without a header")
        return header_from_proto(self._header), self._header.shm_bytes
