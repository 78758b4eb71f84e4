"""gRPC API against a real grpc.aio server over the real core, tiny random models (tests/support/service.py).

How gRPC maps the core (tests/unit/test_core.py tests the core itself): Fetch streaming and its message
sizes, a client leaving mid-stream or mid-wait (outcome `cancelled`, no ERROR), status codes and trailing
metadata, Health, auth. Bad input gets a
status code and a message naming the problem, with the server still serving afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading

import grpc
import httpx
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_service import errors
from encoder_service.api import grpc_server
from encoder_service.cache import key_from_id
from encoder_service.client import AsyncEncoderClient, ImageSource
from encoder_service.protocol import wire
from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc
from tests.support.images import image_bytes, truncated_jpeg
from tests.support.waits import async_wait_for

pytestmark = pytest.mark.timeout(60)

WAIT_S = 20  # bound on every wait in this file


def client(svc, **kw) -> AsyncEncoderClient:
    return AsyncEncoderClient.grpc(svc.grpc_address, timeout=30, **kw)


async def test_fetch_messages_stay_under_1_mib(service_qwen3):
    async with client(service_qwen3) as c:
        (info,) = await c.encode([image_bytes(256, 256, 4)], wait=True)
    image_bytes_ = info.num_tokens * info.row_width * torch_dtype(info.dtype).itemsize
    copies = -(-(5 << 20) // image_bytes_)  # > 5 MiB of rows: more than one default 4 MiB message
    request = pb.FetchRequest(items=[pb.FetchItem(id=info.id, offset=k * info.num_tokens) for k in range(copies)],
                              start=0, end=copies * info.num_tokens)
    async with grpc.aio.insecure_channel(service_qwen3.grpc_address) as channel:
        messages = [m async for m in pb_grpc.EncoderStub(channel).Fetch(request, timeout=30)]
    assert messages[0].WhichOneof("part") == "header" and len(messages) >= 6
    assert all(m.ByteSize() <= 1 << 20 for m in messages)
    assert sum(len(m.data) for m in messages[1:]) == copies * image_bytes_


async def test_client_disconnect_mid_stream_leaves_the_server_serving(service, monkeypatch, caplog):
    # Many small messages, and a record of how far each server-side stream got.
    monkeypatch.setattr(grpc_server, "FETCH_DATA_BYTES", 4096)
    streams = []  # [pieces sent, pieces in all] per Fetch
    data_chunks = wire.grpc_data_chunks

    def recorded_chunks(rows, max_bytes):
        stream = [0, -(-rows.numel() * rows.element_size() // max_bytes)]
        streams.append(stream)
        for piece in data_chunks(rows, max_bytes):
            stream[0] += 1
            yield piece

    def cancelled_fetches() -> float:
        labels = {"transport": "grpc", "method": "fetch", "outcome": "cancelled"}
        return service.sample("encoder_requests_total", labels)

    monkeypatch.setattr(grpc_server.wire, "grpc_data_chunks", recorded_chunks)
    caplog.set_level(logging.WARNING)
    before = cancelled_fetches()
    async with client(service) as c:
        (info,) = await c.encode([image_bytes(224, 224, 5)], wait=True)
        items = [(info.id, k * info.num_tokens) for k in range(64)]
        request = pb.FetchRequest(items=[pb.FetchItem(id=i, offset=o) for i, o in items], start=0,
                                  end=64 * info.num_tokens)
        for _ in range(2):
            async with grpc.aio.insecure_channel(service.grpc_address) as channel:
                call = pb_grpc.EncoderStub(channel).Fetch(request, timeout=30)
                received = 0
                async for _message in call:
                    received += 1
                    if received == 3:
                        call.cancel()
                        break
            # ... and a client that vanishes without cancelling: its channel closes under the stream.
            channel = grpc.aio.insecure_channel(service.grpc_address)
            call = pb_grpc.EncoderStub(channel).Fetch(request, timeout=30)
            assert (await call.read()).WhichOneof("part") == "header"
            await channel.close()
        # The server ends each handler as cancelled (bounded wait: it learns of the disconnect asynchronously)
        await async_wait_for(lambda: cancelled_fetches() - before >= 4, "the 4 fetches cancelled", 10, poll_s=0.05)
        assert cancelled_fetches() - before == 4
        # ... early, not after sending everything: flow control keeps it near the reader. (A stream whose
        # client left right after the header may be cancelled before it starts on the rows: 2 to 4 entries.)
        assert 2 <= len(streams) <= 4 and all(sent < total for sent, total in streams), streams
        got = await c.fetch(items, 0, 64 * info.num_tokens)  # still serving, complete answers
        assert got.rows.shape[0] == 64 * info.num_tokens
    assert not [r for r in caplog.records if r.name.startswith("encoder_service") and r.levelno >= logging.ERROR]


async def _serving(svc):
    async with client(svc) as c:
        (info,) = await c.encode([image_bytes(56, 56, 8)], wait=True)
        assert (await c.fetch([(info.id, 0)], 0, info.num_tokens)).rows.shape[0] == info.num_tokens


@pytest.mark.parametrize("call, code, words", [
    (lambda c, i: c.encode([b"not an image at all"]), "INVALID_ARGUMENT", "image 0: not an image"),
    (lambda c, i: c.encode([]), "INVALID_ARGUMENT", "no images"),
    (lambda c, i: c.encode([image_bytes(56, 56, k) for k in range(9)]), "INVALID_ARGUMENT",
     "number of images in the request is 9, over the limit of 8"),
    (lambda c, i: c.fetch([(i.id, 0)], 5, 5), "INVALID_ARGUMENT", "end must be > start"),
    (lambda c, i: c.fetch([(i.id, 0), (i.id, 1)], 0, 8), "INVALID_ARGUMENT", "overlap"),
    (lambda c, i: c.fetch([(i.id, -3)], 0, 8), "INVALID_ARGUMENT", "offset must be >= 0"),
    (lambda c, i: c.fetch([("0" * 32, 0)], 0, 8), "NOT_FOUND", "unknown id '0000"),
    (lambda c, i: c.fetch([("no such id", 0)], 0, 8), "INVALID_ARGUMENT", "malformed id 'no such id'"),
    (lambda c, i: c.encode([image_bytes(56, 56, 9), truncated_jpeg(5)], wait=True), "INVALID_ARGUMENT",
     "image 1: .*trunc"),
])
async def test_bad_input_gets_a_status_and_a_message(service, call, code, words):
    async with client(service) as c:
        (info,) = await c.encode([image_bytes(56, 56, 9)], wait=True)
        with pytest.raises(errors.EncoderServiceError, match=words) as exc:
            await call(c, info)
        assert exc.value.status == getattr(grpc.StatusCode, code)
    await _serving(service)


def undecodable(message: type, n: int, seed: int) -> list[bytes]:
    """`n` seeded random payloads that `message` cannot parse (most random bytes are not a message)."""
    rng, found = random.Random(seed), []
    for _ in range(50 * n):  # bounded: about a third of random payloads parse
        payload = rng.randbytes(rng.randrange(1, 200))
        try:
            message.FromString(payload)
        except DecodeError:
            found.append(payload)
            if len(found) == n:
                return found
    raise AssertionError(f"only {len(found)} undecodable payloads found")


async def test_undecodable_messages_are_invalid_argument_counted_and_logged_rarely(service, caplog):
    """Issue 31 item 9: bytes that are no message of the method answered UNKNOWN "Unexpected DecodeError",
    with an ERROR and a traceback each, uncounted. Sent raw (no serializer) on a real channel; Health's are
    answered too (its calls are not counted)."""
    caplog.set_level(logging.DEBUG)
    encoder, health = "/encoder.v1.Encoder/", "/grpc.health.v1.Health/"
    methods = {encoder + "Encode": ("encode", pb.EncodeRequest, "unary_unary"),
               encoder + "Fetch": ("fetch", pb.FetchRequest, "unary_stream"),
               encoder + "Release": ("release", pb.ReleaseRequest, "unary_unary"),
               encoder + "Metadata": (None, pb.MetadataRequest, "unary_unary"),
               health + "Check": (None, health_pb2.HealthCheckRequest, "unary_unary"),
               health + "Watch": (None, health_pb2.HealthCheckRequest, "unary_stream")}

    def counted(method: str) -> float:
        return service.sample("encoder_requests_total", {"transport": "grpc", "method": method,
                                                         "outcome": "invalid_input"})

    before = {name: counted(label) for name, (label, _, _) in methods.items() if label}
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        for seed, (path, (label, message, kind)) in enumerate(methods.items()):
            call = getattr(channel, kind)(path)  # bytes in, bytes out
            for payload in undecodable(message, 20, seed):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    answer = call(payload, timeout=WAIT_S)
                    await (answer if kind == "unary_unary" else answer.read())
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
                assert exc.value.details().startswith(
                    f"the request is not an {message.DESCRIPTOR.full_name} message ("), exc.value.details()
    for name, (label, _, _) in methods.items():
        if label:
            assert counted(label) == before[name] + 20, name
    ours = [r for r in caplog.records if r.name.startswith(("encoder_service", "grpc"))]
    assert not [r for r in ours if r.levelno >= logging.ERROR or r.exc_info]
    rare = [r for r in ours if "undecodable" in r.getMessage()]
    assert len(rare) == 1 and rare[0].levelno == logging.WARNING, [r.getMessage() for r in rare]
    await _serving(service)


async def test_a_reused_caller_id_with_other_bytes_is_already_exists(service):
    a, b = image_bytes(70, 50, 62), image_bytes(50, 70, 63)
    async with client(service) as c:
        (first,) = await c.encode([ImageSource(data=a, caller_id="reused-grpc")], wait=True)
        with pytest.raises(errors.Conflict, match="'u:reused-grpc' already names other image bytes") as exc:
            await c.encode([ImageSource(data=b, caller_id="reused-grpc")])
        assert exc.value.status == grpc.StatusCode.ALREADY_EXISTS  # with error-kind "conflict" in its metadata
        (again,) = await c.encode([ImageSource(data=a, caller_id="reused-grpc")])
        assert again.cached and again.grid_thw == first.grid_thw
    await _serving(service)


async def test_an_image_without_data_or_url_is_invalid(service):
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await pb_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(images=[pb.Image(caller_id="x")]), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 0: give exactly one of data or url" in exc.value.details()


async def test_positions_past_int64_cannot_be_sent(service):
    """HTTP answers 400 for them (tests/service/test_http.py: test_bad_fetches); gRPC cannot even carry them,
    and the client says so as the same error type instead of protobuf's ValueError."""
    async with client(service) as c:
        (info,) = await c.encode([image_bytes(56, 56, 9)], wait=True)
        with pytest.raises(errors.InvalidInput, match=r"must be < 2\*\*63"):
            await c.fetch([(info.id, 2**63)], 0, 8)
        last = 2**63 - 1
        got = await c.fetch([(info.id, last - info.num_tokens)], last - 1, last)
        assert [s.position for s in got.segments] == [last - 1]
    with pytest.raises(ValueError, match="out of range"):
        pb.FetchRequest(start=2**63)


async def test_clients_leaving_mid_call_are_cancelled_not_errors(service, monkeypatch, caplog):
    """An Encode waiting for its rows and a Fetch waiting for rows still encoding, each cancelled by its
    client: outcome `cancelled`, one debug line each, and no ERROR from any logger (asyncio's "exception
    was never retrieved" included: it shows when the abandoned futures are collected)."""
    decoding = threading.Event()  # the image stays in its decode until the test lets it go
    backend = service.core.images.backend  # what the engine's prepare stage decodes with
    preprocess = backend.preprocess
    monkeypatch.setattr(backend, "preprocess", lambda data, dtype: (decoding.wait(WAIT_S), preprocess(data, dtype))[1])
    def cancelled() -> tuple[float, float]:
        labels = [{"transport": "grpc", "method": m, "outcome": "cancelled"} for m in ("encode", "fetch")]
        return tuple(service.sample("encoder_requests_total", la) for la in labels)

    caplog.set_level(logging.DEBUG)
    before = cancelled()
    try:
        async with grpc.aio.insecure_channel(service.grpc_address) as channel:
            stub = pb_grpc.EncoderStub(channel)
            data = image_bytes(90, 90, 4242)
            info = (await stub.Encode(pb.EncodeRequest(images=[pb.Image(data=data)]), timeout=30)).images[0]
            calls = [stub.Encode(pb.EncodeRequest(images=[pb.Image(data=data)], wait=True), timeout=30),
                     stub.Fetch(pb.FetchRequest(items=[pb.FetchItem(id=info.id, offset=0)], start=0,
                                                end=info.num_tokens), timeout=30)]
            core = service.core
            flight = core.flights.get(key_from_id(info.id, core.model_fp, core.settings.cache.hash).name)
            # Both wait on the image's flight: two more waiters than the first encode.
            await async_wait_for(lambda: flight.waiters >= 3, "both calls to join the flight", 10, poll_s=0.05)
            assert flight.waiters == 3
            for call in calls:
                call.cancel()
            await async_wait_for(lambda: cancelled() == (before[0] + 1, before[1] + 1), "both calls cancelled", 10,
                                 poll_s=0.05)
    finally:
        decoding.set()
    assert cancelled() == (before[0] + 1, before[1] + 1)
    gc.collect()
    await _serving(service)
    errors_logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors_logged
    assert len([r for r in caplog.records if "cancelled by the client" in r.getMessage()]) == 2


async def test_request_over_the_receive_limit(service):
    async with client(service) as c:
        with pytest.raises(errors.InvalidInput) as exc:
            await c.encode([b"\0" * (4 << 20)])
        assert exc.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    await _serving(service)


@pytest.fixture(scope="module")
def small_queue_service(request, tiny_checkpoint):
    from tests.support.service import running

    return running(request, tiny_checkpoint("qwen2_5_vl"), "--max-queue", "1")


async def test_overload_is_resource_exhausted_with_a_retry_hint(small_queue_service):
    request = pb.EncodeRequest(images=[pb.Image(data=image_bytes(56, 56, 10 + k)) for k in range(2)])
    async with grpc.aio.insecure_channel(small_queue_service.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await pb_grpc.EncoderStub(channel).Encode(request, timeout=30)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "encode queue is full" in exc.value.details() and "max_queue is 1" in exc.value.details()
    trailing = dict(exc.value.trailing_metadata())
    assert trailing["error-kind"] == "overloaded" and float(trailing["retry-after-s"]) > 0
    async with client(small_queue_service) as c:  # the client maps it to Overloaded with the hint
        with pytest.raises(errors.Overloaded, match="queue is full") as err:
            await c.encode([image_bytes(56, 56, 20 + k) for k in range(2)])
        assert err.value.retry_after_s == float(trailing["retry-after-s"])
    await _serving(small_queue_service)


async def test_health_is_serving_only_when_ready(small_queue_service, monkeypatch):
    async def check(service_name=""):
        async with grpc.aio.insecure_channel(small_queue_service.grpc_address) as channel:
            return (await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service_name), timeout=10)).status

    assert await check() == health_pb2.HealthCheckResponse.SERVING
    assert await check("encoder.v1.Encoder") == health_pb2.HealthCheckResponse.SERVING
    monkeypatch.setattr(small_queue_service.core, "ready", lambda: False)
    assert await check() == health_pb2.HealthCheckResponse.NOT_SERVING
    monkeypatch.undo()
    assert await check() == health_pb2.HealthCheckResponse.SERVING


async def test_stop_says_not_serving_during_the_grace_period(tiny_checkpoint):
    from encoder_service.api.service import Service, bind_socket
    from tests.support.service import make_settings

    svc = Service(make_settings(tiny_checkpoint("qwen2_5_vl")), http_sock=bind_socket("127.0.0.1", 0))
    await svc.start()
    stopping = None
    try:
        async with grpc.aio.insecure_channel(svc.grpc_address) as channel, \
                httpx.AsyncClient(base_url=svc.http_address, timeout=10) as http:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stopping = asyncio.create_task(svc.stop(grace_s=10))
            # gRPC is in its grace period (the Watch stream keeps it there) and HTTP still serves.
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await http.get("/health/ready")).status_code == 503
            assert not stopping.done()
            watch.cancel()
    finally:
        await (stopping or svc.stop(grace_s=0))


async def test_auth(auth_service):
    from tests.support.service import AUTH_TOKEN

    for token, words in ((None, "missing bearer token"), ("wrong", "wrong bearer token")):
        async with client(auth_service, token=token) as c:
            for call in (lambda: c.encode([image_bytes(56, 56, 11)]), lambda: c.fetch([("0" * 32, 0)], 0, 4),
                         c.metadata):
                with pytest.raises(errors.Unauthenticated, match=words) as exc:
                    await call()
                assert exc.value.status == grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.insecure_channel(auth_service.grpc_address) as channel:  # health needs no token
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    async with client(auth_service, token=AUTH_TOKEN) as c:
        (info,) = await c.encode([image_bytes(56, 56, 11)], wait=True)
        assert (await c.fetch([(info.id, 2)], 0, 6)).rows.shape[0] == min(4, info.num_tokens)
        assert (await c.metadata())["family"] == "qwen2_vl"


async def test_timings_in_trailing_metadata(service):
    request = pb.EncodeRequest(images=[pb.Image(data=image_bytes(56, 84, 12))], wait=True)
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        call = pb_grpc.EncoderStub(channel).Encode(request, timeout=30)
        response = await call
        trailing = dict(await call.trailing_metadata())
    assert response.images[0].num_tokens > 0
    assert {"x-timing-decode-ms", "x-timing-total-ms"} <= set(trailing)
    assert float(trailing["x-timing-total-ms"]) >= 0


def test_wire_chunk_size_is_under_a_mebibyte():
    assert grpc_server.FETCH_DATA_BYTES == wire.GRPC_DATA_BYTES <= (1 << 20) - 16
