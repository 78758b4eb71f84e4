"""gRPC transports (blocking and grpc.aio) for EncoderClient / AsyncEncoderClient.

Fetch reads its stream's messages raw (no protobuf parse of the row bytes: protocol/grpc_messages.py:
FetchAssembler) and asks for data messages of FETCH_MESSAGE_BYTES. By default it also asks the server to
leave the rows on its HTTP port (`pickup`, api/pickup.py): the header comes on the stream with a ticket and
the rows are read with the HTTP fetch reader (rowpath/raw_http.py) straight into place, on connections of
their own. When a pickup fails (the HTTP port unreachable from here, a load balancer sending it to another
replica) the fetch is asked again on the stream, and this transport stops asking for pickups.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc

from encoder_service.client.destination import Destination
from encoder_service.client.types import ImageInfo, ImageSource, VideoInfo, VideoSource
from encoder_service.errors import DeadlineExceeded, EncoderServiceError, InvalidInput, Unreachable
from encoder_service.protocol import grpc_messages as msgs
from encoder_service.protocol.errors import remote_error
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc
from encoder_service.protocol.wire import RowWriter, WireError, WireHeader
from encoder_service.rowpath.raw_http import READ_THREADS, Cancel, NotRaw, RawHttp, in_thread, read_fetch

log = logging.getLogger(__name__)
# Fetch messages are <= FETCH_MESSAGE_BYTES, but Encode with return_embeddings answers in one message.
DEFAULT_MAX_RECEIVE_BYTES = 1 << 30
# Data messages asked for: the server's default 1 MiB (4 and 16 MiB measured slower: benchmarks/RESULTS.md).
FETCH_MESSAGE_BYTES = 1 << 20
_FETCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Encoder'].full_name}/Fetch"


def _channel_options(max_receive_bytes: int):
    return [("grpc.max_receive_message_length", max_receive_bytes)]


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _encode_request(images: list[ImageSource], wait: bool, return_embeddings: bool) -> pb.EncodeRequest:
    return pb.EncodeRequest(
        images=[pb.Image(data=i.data, caller_id=i.caller_id or "") if i.data is not None
                else pb.Image(url=i.url, caller_id=i.caller_id or "") for i in images],
        wait=wait, return_embeddings=return_embeddings)


def _fetch_request(items, start: int, end: int, shm: dict | None = None, pickup: bool = False,
                   message_bytes: int = 0) -> pb.FetchRequest:
    try:
        return pb.FetchRequest(items=[pb.FetchItem(id=i, offset=o) for i, o in items], start=start, end=end,
                               shm=pb.ShmTarget(**shm) if shm is not None else None,
                               max_message_bytes=message_bytes, pickup=pickup)
    except ValueError as exc:  # past int64: an HTTP server rejects such positions too (ranges.check_position)
        raise InvalidInput(f"fetch positions and offsets must be < 2**63 (gRPC's int64): {exc}") from None


def _encode_videos_request(videos: list[VideoSource], wait: bool, return_embeddings: bool) -> pb.EncodeRequest:
    def message(v: VideoSource) -> pb.Video:
        source = ({"data": v.data} if v.data is not None else {"frames": pb.Frames(images=v.frames)}
                  if v.frames is not None else {"url": v.url})
        return pb.Video(**source, caller_id=v.caller_id or "", **v.options())

    return pb.EncodeRequest(videos=[message(v) for v in videos], wait=wait, return_embeddings=return_embeddings)


def _video_infos(response: pb.EncodeResponse) -> list[VideoInfo]:
    embeddings = list(response.embeddings) or [None] * len(response.videos)
    return [msgs.video_info_from_proto(m, VideoInfo,
                                       embedding=None if e is None else msgs.embedding_from_bytes(m, e))
            for m, e in zip(response.videos, embeddings)]


def _infos(response: pb.EncodeResponse) -> list[ImageInfo]:
    embeddings = list(response.embeddings) or [None] * len(response.images)
    return [msgs.info_from_proto(m, ImageInfo, embedding=None if e is None else msgs.embedding_from_bytes(m, e))
            for m, e in zip(response.images, embeddings)]


def _target_host(target: str) -> str | None:
    """The host of a gRPC target "host:port", "[v6]:port" or "dns:///host:port"; None for other forms."""
    if target.startswith("dns:"):
        target = target.rsplit("/", 1)[-1]
    elif "://" in target or target.startswith(("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")):
        return None
    host, _, port = target.rpartition(":")
    return host.strip("[]") or None if port.isdigit() else None


class _Pickups:
    """The HTTP side of a transport's fetches: one RawHttp per port the server names, on the target's host.
    Off after the first pickup that fails for any other reason than the timeout."""

    def __init__(self, target: str, token: str | None, enabled: bool):
        self._host = _target_host(target) if enabled else None
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._raw: dict[int, RawHttp] = {}
        self._lock = threading.Lock()  # a blocking transport may fetch from several threads

    @property
    def enabled(self) -> bool:
        return self._host is not None

    def take(self, ticket: tuple[str, int], writer: RowWriter, timeout, cancel: Cancel | None = None) -> bool:
        """Reads the rows of `ticket` with `writer`: True, or False when the pickup failed (ask on the stream)."""
        token, port = ticket
        with self._lock:
            if self._host is None:  # turned off by another thread meanwhile
                return False
            raw = self._raw.get(port)
            if raw is None:
                raw = self._raw[port] = RawHttp(self._host, port, "", self._headers)

        def writer_for(got: WireHeader) -> RowWriter:
            if got != writer.header:
                raise WireError(f"pickup answered rows of another fetch: {got} for {writer.header}")
            return writer

        body = json.dumps({"token": token}).encode()
        try:
            raw.post("/v1/fetch/pickup", body, timeout, read_fetch(writer_for), cancel=cancel)
            return True
        except DeadlineExceeded:
            raise
        except (EncoderServiceError, NotRaw) as exc:
            if cancel is not None and cancel.fired:
                raise
            log.warning("gRPC fetch: the rows' pickup on %s:%d failed (%s); fetching on the gRPC stream from now "
                        "on", self._host, port, exc)
            self.close()
            return False

    def close(self) -> None:
        with self._lock:
            self._host = None
            raws, self._raw = list(self._raw.values()), {}
        for raw in raws:
            raw.close()


def _error(exc: grpc.RpcError):
    trailing = dict(exc.trailing_metadata() or ())
    retry = trailing.get(msgs.RETRY_AFTER_S)
    kind, details = trailing.get(msgs.ERROR_KIND), exc.details() or ""
    if kind is None and exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details:
        unreachable = Unreachable(f"cannot reach the server: {details}")  # gRPC's own: no server answered
        unreachable.status = exc.code()
        return unreachable
    return remote_error(kind, details, exc.code(), float(retry) if retry else None)


class GrpcTransport:
    def __init__(self, target: str, *, token: str | None = None,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES, pickup: bool = True,
                 message_bytes: int = FETCH_MESSAGE_BYTES):
        self._channel = grpc.insecure_channel(target, options=_channel_options(max_receive_bytes))
        self._message_bytes = min(message_bytes, max_receive_bytes)
        self._stub, self._md = pb_grpc.EncoderStub(self._channel), _metadata(token)
        self._fetch = self._channel.unary_stream(_FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString)
        self._pickups = _Pickups(target, token, pickup)

    def encode(self, images, wait, return_embeddings, timeout):
        try:
            response = self._stub.Encode(_encode_request(images, wait, return_embeddings),
                                         timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return _infos(response)

    def encode_videos(self, videos, wait, return_embeddings, timeout):
        try:
            response = self._stub.Encode(_encode_videos_request(videos, wait, return_embeddings),
                                         timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return _video_infos(response)

    def fetch(self, items, start, end, dest: Destination, timeout):
        stream = msgs.FetchAssembler(dest.writer)
        request = _fetch_request(items, start, end, pickup=self._pickups.enabled, message_bytes=self._message_bytes)
        header = self._stream(request, stream, timeout)
        if stream.pickup is not None and not self._pickups.take(stream.pickup, stream.writer, timeout):
            return self.fetch(items, start, end, dest, timeout)  # pickups are off now: on the stream
        return header, dest.finish()

    def fetch_shm(self, items, start, end, target, timeout):
        return self._stream(_fetch_request(items, start, end, target), msgs.ShmReply(), timeout)

    def _stream(self, request, sink, timeout):
        """One Fetch stream into `sink` (add(message) per raw message, then finish())."""
        call = self._fetch(request, timeout=timeout, metadata=self._md)
        try:
            for message in call:
                sink.add(message)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        finally:
            call.cancel()  # no-op after a clean end; frees the stream when decoding failed midway
        return sink.finish()

    def release(self, ids, timeout):
        try:
            return msgs.release_from_proto(self._stub.Release(pb.ReleaseRequest(ids=ids), timeout=timeout,
                                                              metadata=self._md))
        except grpc.RpcError as exc:
            raise _error(exc) from exc

    def metadata(self, timeout):
        try:
            return json.loads(self._stub.Metadata(pb.MetadataRequest(), timeout=timeout, metadata=self._md).json)
        except grpc.RpcError as exc:
            raise _error(exc) from exc

    def close(self):
        self._pickups.close()
        self._channel.close()


class AsyncGrpcTransport:
    """grpc.aio; create it inside the event loop that uses it."""

    def __init__(self, target: str, *, token: str | None = None,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES, pickup: bool = True,
                 message_bytes: int = FETCH_MESSAGE_BYTES, fetch_threads: int = READ_THREADS):
        self._channel = grpc.aio.insecure_channel(target, options=_channel_options(max_receive_bytes))
        self._message_bytes = min(message_bytes, max_receive_bytes)
        self._stub, self._md = pb_grpc.EncoderStub(self._channel), _metadata(token)
        self._fetch = self._channel.unary_stream(_FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString)
        self._pickups = _Pickups(target, token, pickup)
        self._threads = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="encoder-pickup")

    async def encode(self, images, wait, return_embeddings, timeout):
        try:
            response = await self._stub.Encode(_encode_request(images, wait, return_embeddings),
                                               timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return _infos(response)

    async def encode_videos(self, videos, wait, return_embeddings, timeout):
        try:
            response = await self._stub.Encode(_encode_videos_request(videos, wait, return_embeddings),
                                               timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return _video_infos(response)

    async def fetch(self, items, start, end, dest: Destination, timeout):
        stream = msgs.FetchAssembler(dest.writer)
        request = _fetch_request(items, start, end, pickup=self._pickups.enabled, message_bytes=self._message_bytes)
        header = await self._stream(request, stream, timeout)
        if stream.pickup is not None:
            take = partial(self._pickups.take, stream.pickup, stream.writer, timeout)  # take(..., cancel)
            if not await in_thread(self._threads, take, dest):
                return await self.fetch(items, start, end, dest, timeout)  # pickups are off now: on the stream
        return header, dest.finish()

    async def fetch_shm(self, items, start, end, target, timeout):
        return await self._stream(_fetch_request(items, start, end, target), msgs.ShmReply(), timeout)

    async def _stream(self, request, sink, timeout):
        call = self._fetch(request, timeout=timeout, metadata=self._md)
        try:
            async for message in call:
                sink.add(message)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        finally:
            call.cancel()
        return sink.finish()

    async def release(self, ids, timeout):
        try:
            response = await self._stub.Release(pb.ReleaseRequest(ids=ids), timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return msgs.release_from_proto(response)

    async def metadata(self, timeout):
        try:
            response = await self._stub.Metadata(pb.MetadataRequest(), timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return json.loads(response.json)

    async def close(self):
        self._pickups.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        await self._channel.close()
