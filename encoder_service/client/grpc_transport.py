"""gRPC transports (blocking and grpc.aio) for EncoderClient / AsyncEncoderClient."""

from __future__ import annotations

import json

import grpc

from encoder_service.client.types import ImageInfo, ImageSource
from encoder_service.client.errors import remote_error
from encoder_service.errors import InvalidInput
from encoder_service.protocol import grpc_messages as msgs
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc

# Fetch messages are <= 1 MiB, but Encode with return_embeddings answers in one message.
DEFAULT_MAX_RECEIVE_BYTES = 1 << 30


def _channel_options(max_receive_bytes: int):
    return [("grpc.max_receive_message_length", max_receive_bytes)]


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _encode_request(images: list[ImageSource], wait: bool, return_embeddings: bool) -> pb.EncodeRequest:
    return pb.EncodeRequest(
        images=[pb.Image(data=i.data, caller_id=i.caller_id or "") if i.data is not None
                else pb.Image(url=i.url, caller_id=i.caller_id or "") for i in images],
        wait=wait, return_embeddings=return_embeddings)


def _fetch_request(items, start: int, end: int, shm: dict | None = None) -> pb.FetchRequest:
    try:
        return pb.FetchRequest(items=[pb.FetchItem(id=i, offset=o) for i, o in items], start=start, end=end,
                               shm=pb.ShmTarget(**shm) if shm is not None else None)
    except ValueError as exc:  # past int64: an HTTP server rejects such positions too (ranges.check_position)
        raise InvalidInput(f"fetch positions and offsets must be < 2**63 (gRPC's int64): {exc}") from None


def _infos(response: pb.EncodeResponse) -> list[ImageInfo]:
    embeddings = list(response.embeddings) or [None] * len(response.images)
    return [msgs.info_from_proto(m, ImageInfo, embedding=None if e is None else msgs.embedding_from_bytes(m, e))
            for m, e in zip(response.images, embeddings)]


def _error(exc: grpc.RpcError):
    trailing = dict(exc.trailing_metadata() or ())
    retry = trailing.get(msgs.RETRY_AFTER_S)
    return remote_error(trailing.get(msgs.ERROR_KIND), exc.details() or "", exc.code(),
                        float(retry) if retry else None)


class GrpcTransport:
    def __init__(self, target: str, *, token: str | None = None,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES):
        self._channel = grpc.insecure_channel(target, options=_channel_options(max_receive_bytes))
        self._stub, self._md = pb_grpc.EncoderStub(self._channel), _metadata(token)

    def encode(self, images, wait, return_embeddings, timeout):
        try:
            response = self._stub.Encode(_encode_request(images, wait, return_embeddings),
                                         timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return _infos(response)

    def fetch(self, items, start, end, out, timeout):
        return self._stream(_fetch_request(items, start, end), msgs.FetchAssembler(out, start), timeout)

    def fetch_shm(self, items, start, end, target, timeout):
        return self._stream(_fetch_request(items, start, end, target), msgs.ShmReply(), timeout)

    def _stream(self, request, sink, timeout):
        """One Fetch stream into `sink` (add(message) per message, then finish())."""
        call = self._stub.Fetch(request, timeout=timeout, metadata=self._md)
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
            return self._stub.Release(pb.ReleaseRequest(ids=ids), timeout=timeout, metadata=self._md).released
        except grpc.RpcError as exc:
            raise _error(exc) from exc

    def metadata(self, timeout):
        try:
            return json.loads(self._stub.Metadata(pb.MetadataRequest(), timeout=timeout, metadata=self._md).json)
        except grpc.RpcError as exc:
            raise _error(exc) from exc

    def close(self):
        self._channel.close()


class AsyncGrpcTransport:
    """grpc.aio; create it inside the event loop that uses it."""

    def __init__(self, target: str, *, token: str | None = None,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES):
        self._channel = grpc.aio.insecure_channel(target, options=_channel_options(max_receive_bytes))
        self._stub, self._md = pb_grpc.EncoderStub(self._channel), _metadata(token)

    async def encode(self, images, wait, return_embeddings, timeout):
        try:
            response = await self._stub.Encode(_encode_request(images, wait, return_embeddings),
                                               timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return _infos(response)

    async def fetch(self, items, start, end, out, timeout):
        return await self._stream(_fetch_request(items, start, end), msgs.FetchAssembler(out, start), timeout)

    async def fetch_shm(self, items, start, end, target, timeout):
        return await self._stream(_fetch_request(items, start, end, target), msgs.ShmReply(), timeout)

    async def _stream(self, request, sink, timeout):
        call = self._stub.Fetch(request, timeout=timeout, metadata=self._md)
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
        return response.released

    async def metadata(self, timeout):
        try:
            response = await self._stub.Metadata(pb.MetadataRequest(), timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _error(exc) from exc
        return json.loads(response.json)

    async def close(self):
        await self._channel.close()
