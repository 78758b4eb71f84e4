"""gRPC (grpc.aio) adapter over EncoderCore: encoder.v1.Encoder plus the standard grpc.health.v1.Health.

Thin on purpose: convert messages (protocol/grpc_messages.py), call the core, map errors once
(api/errors.py). Fetch streams a header message, then the rows' bytes in messages of at most 1 MiB (under
every peer's default 4 MiB receive limit; streaming measured 3x faster than one big unary reply), or up to
the client's FetchRequest.max_message_bytes (capped at MAX_FETCH_MESSAGE_BYTES). Data messages are framed
by protocol/wire.py from views of the rows (one copy, not protobuf's three). A Fetch with a
ShmTarget answers the header alone (the rows are in the client's file, protocol/shm.py); one asking for a
pickup answers the header with a ticket when the HTTP port can serve the rows (api/pickup.py).

grpc.aio parses a request in its own code, before the handler runs: bytes that are no message of the method's
type would end the call UNKNOWN "Unexpected DecodeError", with an ERROR and a traceback logged per call, and
uncounted. Each method's deserializer here answers an `Undecodable` marker instead, which the handler answers
as every bad request (INVALID_ARGUMENT, counted as `invalid_input`), logged as one WARNING a minute at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from encoder_service.api import errors as api_errors
from encoder_service.api.auth import BearerAuth
from encoder_service.api.pickup import Pickups
from encoder_service.api.requests import REQUEST_ID, served
from encoder_service.core import FetchItem, ImageInput
from encoder_service.core.types import VideoInput
from encoder_service.errors import EncoderServiceError, InvalidInput, Overloaded
from encoder_service.protocol import grpc_messages as msgs
from encoder_service.protocol import wire
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc
from encoder_service.protocol.shm import ShmTarget
from encoder_service.protocol.timing import timing_headers
from encoder_service.protocol.video_request import OPTIONS
from encoder_service.settings import PortUnavailable

log = logging.getLogger(__name__)
# What grpc.aio raises from a write to a call its client has ended (not exported by grpc itself).
_ExecuteBatchError = grpc._cython.cygrpc.ExecuteBatchError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Encoder"].full_name  # "encoder.v1.Encoder"
# Methods reachable without a token: probes must work when the token is unknown to the prober.
_OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Room for the protobuf framing around images that fill --max-body-bytes.
_REQUEST_OVERHEAD_BYTES = 1 << 20
# Row bytes per Fetch data message (read per call, so tests can shrink it to get many messages).
FETCH_DATA_BYTES = wire.GRPC_DATA_BYTES
MAX_FETCH_MESSAGE_BYTES = 16 << 20  # the most a client's max_message_bytes gets
UNDECODABLE_LOG_EVERY_S = 60.0  # at most one WARNING line this often about undecodable requests


async def start(core, settings, pickups: Pickups | None = None, http_port: int | None = None
                ) -> tuple[grpc.aio.Server, ReadinessHealth]:
    """Serve `core` on settings.server.host:settings.server.grpc_port (started; caller stops it, after
    `health.enter_graceful_shutdown()` so open Health.Watch streams hear NOT_SERVING during the grace).
    `pickups` (shared with the HTTP app on `http_port`): where Fetch leaves rows when a client asks."""
    server = grpc.aio.server(
        interceptors=[_AuthInterceptor(BearerAuth(settings.server.auth_token))],
        options=[
            ("grpc.max_receive_message_length", settings.limits.max_body_bytes + _REQUEST_OVERHEAD_BYTES),
            # Encode with return_embeddings answers in one message; Fetch messages stay <= 1 MiB.
            ("grpc.max_send_message_length", -1),
            # grpc sets SO_REUSEPORT by default: a second server on the same port would silently share the
            # traffic instead of failing to start.
            ("grpc.so_reuseport", 0),
        ])
    rarely = _RareWarning(UNDECODABLE_LOG_EVERY_S)  # one per server: its own minute
    handlers = _handlers(pb_grpc.add_EncoderServicer_to_server, EncoderServicer(core, pickups, http_port))
    # Fetch's serializer passes our own framed data messages through.
    handlers["Fetch"] = handlers["Fetch"]._replace(response_serializer=msgs.serialize_fetch_chunk)
    _register(server, pb.DESCRIPTOR.services_by_name["Encoder"], handlers, rarely)
    health_servicer = ReadinessHealth(core)
    _register(server, health_pb2.DESCRIPTOR.services_by_name["Health"],
              _handlers(health_pb2_grpc.add_HealthServicer_to_server, health_servicer), rarely)
    address = f"{settings.server.host}:{settings.server.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:  # the address can't be bound (taken since the service checked it, ...)
        raise PortUnavailable.of("grpc_port", settings.server.host, settings.server.grpc_port, None) from exc
    await server.start()
    log.info("gRPC serving %s on %s", SERVICE_NAME, address)
    return server, health_servicer


def _handlers(add_to_server, servicer) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers a generated `add_..._to_server` registers for `servicer`, by method name."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}

    class _Collect:
        def add_generic_rpc_handlers(self, _):
            pass

        def add_registered_method_handlers(self, _, method_handlers):
            handlers.update(method_handlers)

    add_to_server(servicer, _Collect())
    return handlers


def _register(server, service, handlers: dict[str, grpc.RpcMethodHandler], rarely: _RareWarning) -> None:
    """`handlers` of `service` (its protobuf ServiceDescriptor) on `server`, each method's deserializer
    answering an `Undecodable` marker for bytes it cannot parse."""
    methods = service.methods_by_name
    handlers = {name: handler._replace(request_deserializer=_lenient(
        handler.request_deserializer, methods[name].input_type.full_name, f"/{service.full_name}/{name}", rarely))
        for name, handler in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are no message of its method's type (what the deserializer answers for them)."""

    message: str  # the type's full name
    reason: str  # protobuf's

    def error(self) -> InvalidInput:
        return InvalidInput(f"the request is not an {self.message} message ({self.reason})")


def _lenient(deserialize, message: str, method: str, rarely: _RareWarning):
    """`deserialize`, with an `Undecodable` for bytes it cannot parse (instead of raising in grpc.aio's code)."""

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:
            rarely.note(method)
            return Undecodable(message, str(exc).removeprefix(f"Error parsing message with type '{message}': "))

    return parse


class _RareWarning:
    """One WARNING about undecodable requests per `every_s` at most, with how many came since the last one (any
    number of garbage requests costs a few log lines, not a traceback each)."""

    def __init__(self, every_s: float):
        self._every_s, self._next, self._count = every_s, 0.0, 0

    def note(self, method: str) -> None:
        self._count += 1
        now = time.monotonic()
        if now >= self._next:
            log.warning("undecodable gRPC requests: %d since the last such line (the latest to %s), each answered "
                        "INVALID_ARGUMENT and counted in encoder_requests_total (this line: at most every %g s)",
                        self._count, method, self._every_s)
            self._next, self._count = now + self._every_s, 0


class EncoderServicer(pb_grpc.EncoderServicer):
    def __init__(self, core, pickups: Pickups | None = None, http_port: int | None = None):
        self._core, self._pickups, self._http_port = core, pickups, http_port

    async def Encode(self, request: pb.EncodeRequest, context) -> pb.EncodeResponse:
        async with self._rpc(context, request, "encode") as call:
            images = [_image_input(img) for img in request.images]
            videos = [_video_input(v) for v in request.videos]
            result = await self._core.encode(images, wait=request.wait, return_embeddings=request.return_embeddings,
                                             timeout_s=_time_left(context), videos=videos)  # waits for embeddings
            call.trailing(timing_headers(result.timings))
            return pb.EncodeResponse(images=[msgs.info_to_proto(i) for i in result.images],
                                     videos=[msgs.video_info_to_proto(v) for v in result.videos],
                                     embeddings=[bytes(wire.row_bytes(t)) for t in (result.embeddings or ())])

    async def Fetch(self, request: pb.FetchRequest, context) -> None:
        # context.write rather than an async generator: a client that goes away cancels this coroutine at
        # its pending write, so the rows are released at once (a dropped generator waits for the GC).
        async with self._rpc(context, request, "fetch") as call:
            items = [FetchItem(id=i.id, offset=i.offset) for i in request.items]
            shm = (ShmTarget(request.shm.name, request.shm.offset, request.shm.by_position)
                   if request.HasField("shm") else None)
            result = await self._core.fetch(items, request.start, request.end, timeout_s=_time_left(context),
                                            shm=shm)
            # Trailing metadata leaves after the last message; the core's (timed) work is done now.
            call.trailing(timing_headers(result.timings))
            wire_header = wire.WireHeader.of_fetch(result)
            header = msgs.header_to_proto(wire_header)
            if shm is not None:  # the rows are in the client's file: the header alone answers
                header.shm_bytes = result.shm_bytes
                await context.write(pb.FetchChunk(header=header))
                return
            if request.pickup and self._pickups is not None and result.rows.numel():
                token = self._pickups.put(wire_header, result.rows)
                if token is not None:  # else too many rows wait already: they go on the stream
                    header.pickup_token, header.pickup_port = token, self._http_port
                    await context.write(pb.FetchChunk(header=header))
                    return
            await context.write(pb.FetchChunk(header=header))
            # Each write waits for flow control: the stream stays a few messages ahead of the reader.
            for piece in wire.grpc_data_chunks(result.rows, _data_bytes(request.max_message_bytes)):
                await context.write(wire.grpc_data_message(piece))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        async with self._rpc(context, request, "release"):
            return msgs.release_to_proto(self._core.release(list(request.ids)))

    async def Metadata(self, request: pb.MetadataRequest, context) -> pb.MetadataResponse:
        async with self._rpc(context, request):
            return pb.MetadataResponse(json=json.dumps(self._core.metadata(), default=str))

    @contextlib.asynccontextmanager
    async def _rpc(self, context, request, method: str | None = None):
        """The one place errors become gRPC statuses (an `Undecodable` request's too: before the handler's body
        runs). A `method` is served as HTTP serves its requests (api/requests.py: request id in the trailing
        metadata, metrics, access line)."""
        core = self._core
        given = dict(context.invocation_metadata() or ()).get(REQUEST_ID)
        with (served(core.metrics, "grpc", method, given, access_log=core.settings.server.access_log) if method
              else contextlib.nullcontext()) as serving:
            call = _Call(context, serving.request_id if serving is not None else None)
            call.trailing()
            try:
                if isinstance(request, Undecodable):
                    raise request.error()
                yield call
            except asyncio.CancelledError:  # the client left (or its deadline passed) mid-call: not our failure
                log.debug("gRPC %s cancelled by the client", method or "call")
                raise
            except Exception as exc:
                if _client_gone(context, exc):  # a write or abort raced the client's cancel or deadline
                    if serving is not None:
                        serving.observed.cancelled()
                    log.debug("gRPC %s: the client left before its answer (%s)", method or "call",
                              type(exc).__name__)
                    return
                if serving is not None:
                    serving.observed.failed(exc)
                await _abort(context, exc, call.metadata)


class _Call:
    """One call's trailing metadata: what its handler adds (the timings) and its request id."""

    def __init__(self, context, request_id: str | None):
        self._context = context
        self.metadata: tuple[tuple[str, str], ...] = () if request_id is None else ((REQUEST_ID, request_id),)

    def trailing(self, pairs: tuple[tuple[str, str], ...] = ()) -> None:
        self._context.set_trailing_metadata((*pairs, *self.metadata))


def _client_gone(context, exc: Exception) -> bool:
    """Whether `exc` only says that the call is over on the client's side: it cancelled, or its deadline
    passed, while the handler was writing (grpc.aio then fails the write with its ExecuteBatchError rather
    than cancelling the handler). Our own errors are answers, never this."""
    if isinstance(exc, EncoderServiceError):
        return False
    remaining = context.time_remaining()
    return context.cancelled() or (remaining is not None and remaining <= 0) or isinstance(exc, _ExecuteBatchError)


def _data_bytes(max_message_bytes: int) -> int:
    """Row bytes per data message: FETCH_DATA_BYTES unless the client takes larger messages."""
    if max_message_bytes <= FETCH_DATA_BYTES + wire.GRPC_FRAMING_BYTES:
        return FETCH_DATA_BYTES
    return min(max_message_bytes, MAX_FETCH_MESSAGE_BYTES) - wire.GRPC_FRAMING_BYTES


def _time_left(context) -> float | None:
    """The call's deadline as the core's timeout_s: None without one; a deadline already past is 0 (answer
    with what is ready now), not a negative timeout (which the core rejects as a bad request)."""
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining)


def _image_input(img: pb.Image) -> ImageInput:
    """Neither source set: the core's InvalidInput (core/images.py: read), as for HTTP."""
    source = img.WhichOneof("source")
    return ImageInput(data=img.data if source == "data" else None, url=img.url if source == "url" else None,
                      caller_id=img.caller_id or None)


def _video_input(video: pb.Video) -> VideoInput:
    """Unset options are None (the checkpoint's); no source: the core's InvalidInput, as for HTTP."""
    source = video.WhichOneof("source")
    options = {name: getattr(video, name) if video.HasField(name) else None for name in OPTIONS}
    return VideoInput(data=video.data if source == "data" else None,
                      frames=tuple(video.frames.images) if source == "frames" else None,
                      url=video.url if source == "url" else None, caller_id=video.caller_id or None, **options)


async def _abort(context, exc: Exception, metadata: tuple[tuple[str, str], ...] = ()):
    """Ends the RPC with the status api/errors.py gives `exc`, `metadata` in its trailing metadata (raises
    grpc's AbortError)."""
    if isinstance(exc, EncoderServiceError):
        kind, message = exc.kind, exc.message
    else:  # a bug, not a request problem: keep the traceback in the log, not in the answer
        log.exception("gRPC %s failed", type(exc).__name__)
        kind, message = "internal", "internal error"
    trailing = [(msgs.ERROR_KIND, kind), *metadata]
    if isinstance(exc, Overloaded):
        trailing.append((msgs.RETRY_AFTER_S, f"{exc.retry_after_s:g}"))
    await context.abort(api_errors.grpc_code(exc), message, trailing_metadata=tuple(trailing))


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer token in the `authorization` metadata (auth.py); Health and reflection stay open."""

    def __init__(self, auth: BearerAuth):
        self._auth = auth

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not self._auth.enabled or details.method.startswith(_OPEN_METHOD_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        try:
            self._auth.check(metadata.get("authorization"))
        except EncoderServiceError as exc:
            return _denied(handler, exc)
        return handler


def _denied(handler: grpc.RpcMethodHandler, exc: EncoderServiceError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts (the request body is never parsed)."""

    async def deny(request, context):
        await _abort(context, exc)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, response_serializer=handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, response_serializer=handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(deny, response_serializer=handler.response_serializer)


class ReadinessHealth(health.aio.HealthServicer):
    """grpc.health.v1 answering SERVING only while core.ready() (checked on every Check / Watch start).

    Watch streams see a change when a Check or a new Watch observes it (the core exposes no readiness
    event to wait on, and a polling task would be a sleep loop).
    """

    _SERVICES = ("", SERVICE_NAME)

    def __init__(self, core):
        super().__init__()
        self._core = core

    async def _refresh(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self._core.ready()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in self._SERVICES:
            await self.set(service, status)

    async def Check(self, request, context):
        await _refuse_undecodable(request, context)
        await self._refresh()
        return await super().Check(request, context)

    async def Watch(self, request, context):
        await _refuse_undecodable(request, context)
        await self._refresh()
        return await super().Watch(request, context)


async def _refuse_undecodable(request, context) -> None:
    """Health's calls are not requests of the metrics: an undecodable one is answered, not counted."""
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error().message)
