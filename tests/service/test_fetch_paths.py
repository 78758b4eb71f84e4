"""Every way rows travel gives the same bytes (issue 20): the raw-socket HTTP reader and httpx, gRPC with the
pickup over HTTP and on the stream, shared memory; the blocking and the asyncio client; no `out`, an `out`
written in place, one of another dtype, a strided one; one stream or a fetch split over several. The
reference is the encode's own answer (return_embeddings), compared byte for byte."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from encoder_service.client import AsyncEncoderClient, EncoderClient, PromptLayout
from encoder_service.client import base as client_base
from encoder_service.client import destination
from encoder_service.ranges import chunks, plan_chunk
from tests.support.images import image_bytes as png
from tests.support.layouts import prompt_layout

pytestmark = pytest.mark.timeout(120)

PATHS = ["http raw", "http httpx", "grpc pickup", "grpc stream", "http shm", "grpc shm"]
OUTS = ["none", "in place", "float16", "strided"]


def _kw(path: str, asynchronous: bool, shm_dir) -> dict:
    if path == "http httpx":  # a transport of its own: the raw reader steps aside
        return {"transport": httpx.AsyncHTTPTransport() if asynchronous else httpx.HTTPTransport()}
    if path == "grpc stream":
        return {"pickup": False}
    if path.endswith("shm"):
        return {"shm": True, "shm_dir": str(shm_dir)}
    return {}


def _client(svc, path: str, asynchronous: bool, shm_dir, **kw):
    cls = AsyncEncoderClient if asynchronous else EncoderClient
    kw |= _kw(path, asynchronous, shm_dir)
    return cls.http(svc.url, timeout=30, **kw) if path.startswith("http") else \
        cls.grpc(svc.grpc_address, timeout=30, **kw)


def _layout(infos) -> PromptLayout:
    """Chunks that cut images and hold several."""
    return prompt_layout(infos, lead=5, gap=2, tail=3)


def _out(kind: str, n: int, width: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "float16":
        return torch.zeros(n, width, dtype=torch.float16)
    if kind == "strided":
        return torch.zeros(n, 2 * width)[:, :width]
    return torch.zeros(n, width)


def _check(chunk, layout, full, out_kind) -> None:
    expected = plan_chunk(layout.items, chunk.start, chunk.end)
    assert chunk.segments == expected
    if out_kind == "none":
        want = torch.cat([full[s.id][s.row_start:s.row_end] for s in expected])
        assert chunk.rows.dtype == want.dtype and torch.equal(chunk.rows.view(torch.uint8), want.view(torch.uint8))
        return
    want = torch.zeros(chunk.end - chunk.start, chunk.rows.shape[1], dtype=chunk.rows.dtype)
    for s in expected:
        want[s.position - chunk.start:s.position - chunk.start + s.num_rows] = full[s.id][s.row_start:s.row_end]
    assert torch.equal(chunk.rows.contiguous().view(torch.uint8), want.view(torch.uint8))


def _pickups(svc) -> float:
    return svc.sample("encoder_requests_total", {"transport": "http", "method": "pickup", "outcome": "ok"})


def _check_path(c, svc, path: str, pickups_before: float) -> None:
    """The path asked for is the one that ran (no silent fallback hides a broken fast path)."""
    transport = c._transport
    if path == "http raw":
        assert transport._raw.raw is not None
    if path == "http httpx":
        assert transport._raw.raw is None
    if path == "grpc pickup":
        assert transport._pickups.enabled and _pickups(svc) > pickups_before
    if path == "grpc stream":
        assert _pickups(svc) == pickups_before


@pytest.mark.parametrize("split", [False, True], ids=["one stream", "split"])
@pytest.mark.parametrize("out_kind", OUTS)
@pytest.mark.parametrize("path", PATHS)
def test_sync_paths_give_the_encodes_bytes(shm_service_qwen3, shm_dir, path, out_kind, split, monkeypatch):
    if split:  # every chunk with an `out` goes over 3 connections
        monkeypatch.setattr(client_base, "SPLIT_BYTES", 1)
    svc = shm_service_qwen3
    with _client(svc, path, False, shm_dir, fetch_streams=3) as c:
        infos = c.encode([png(96, 64, 41), png(64, 64, 42), png(32, 96, 43)], return_embeddings=True)
        full = {i.id: i.embedding for i in infos}
        layout, width = _layout(infos), infos[0].row_width
        before = _pickups(svc)
        for start, end in chunks(layout.prompt_len, 11):
            items = [(i, o) for i, o, n in layout.items if o < end and o + n > start]
            if items:
                _check(c.fetch(items, start, end, out=_out(out_kind, end - start, width)), layout, full, out_kind)
        _check_path(c, svc, path, before)


@pytest.mark.parametrize("split", [False, True], ids=["one stream", "split"])
@pytest.mark.parametrize("path", PATHS)
async def test_async_paths_give_the_encodes_bytes(shm_service_qwen3, shm_dir, path, split, monkeypatch):
    if split:
        monkeypatch.setattr(client_base, "SPLIT_BYTES", 1)
    svc = shm_service_qwen3
    async with _client(svc, path, True, shm_dir, fetch_streams=3) as c:
        infos = await c.encode([png(96, 64, 44), png(64, 64, 45), png(32, 96, 46)], return_embeddings=True)
        full = {i.id: i.embedding for i in infos}
        layout, width = _layout(infos), infos[0].row_width
        before = _pickups(svc)
        for out_kind in OUTS:
            buffer = _out(out_kind, layout.prompt_len, width)
            got = [chunk async for chunk in c.iter_chunks(
                layout, 11, out=None if buffer is None else (lambda s, e: buffer[s:e]))]
            for chunk in got:
                if chunk.segments:
                    _check(chunk, layout, full, out_kind)
        _check_path(c, svc, path, before)


@pytest.mark.parametrize("split", [False, True], ids=["one stream", "split"])
@pytest.mark.parametrize("path", [p for p in PATHS if not p.endswith("shm")])
def test_staged_fetches_of_changing_sizes_reuse_the_clients_buffers(service_qwen3, path, split, monkeypatch):
    """An `out` the rows can't land in directly (on a GPU a CUDA one; here float16) is staged in a host
    buffer the client reuses: fetches that grow and shrink, one at a time and from threads at once, each get
    their rows, a repeated fetch takes no new buffer, and the idle buffers stay bounded."""
    monkeypatch.setattr(destination, "STAGING_ROUND_BYTES", 64)  # every size a buffer of its own size
    if split:
        monkeypatch.setattr(client_base, "SPLIT_BYTES", 1)
    with _client(service_qwen3, path, False, None, fetch_streams=3) as c:
        small, large = c.encode([png(32, 32, 54), png(128, 96, 55)], return_embeddings=True)
        assert large.num_tokens >= 3 * small.num_tokens

        def fetch(info) -> None:
            out = torch.zeros(info.num_tokens, info.row_width, dtype=torch.float16)
            assert c.fetch([(info.id, 0)], 0, info.num_tokens, out=out).rows is out
            assert torch.equal(out, info.embedding.to(torch.float16))

        for info in (small, large, large, small, large):
            fetch(info)
        c.fetch_streams = 1  # one fetch at a time (split streams overlap more or less: as many buffers)
        fetch(large)
        kept = {id(b) for b in c._staging_buffers.idle()}
        fetch(large)
        assert {id(b) for b in c._staging_buffers.idle()} == kept
        c.fetch_streams = 3
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(fetch, [small, large] * 6))
        assert 0 < len(c._staging_buffers.idle()) <= destination.STAGING_IDLE


def test_split_fetch_answers_like_one_fetch(service_qwen3, monkeypatch):
    """Segments cut at the split points are joined again; each part is one request of its own."""
    monkeypatch.setattr(client_base, "SPLIT_BYTES", 1)
    with EncoderClient.http(service_qwen3.url, timeout=30, fetch_streams=4) as split, \
            EncoderClient.http(service_qwen3.url, timeout=30, fetch_streams=1) as whole:
        infos = whole.encode([png(128, 96, 47), png(64, 32, 48)], wait=True)
        layout = _layout(infos)
        width = infos[0].row_width

        def fetches() -> float:
            return service_qwen3.sample("encoder_requests_total",
                                        {"transport": "http", "method": "fetch", "outcome": "ok"})

        n0 = fetches()
        a = whole.fetch(layout.items, 0, layout.prompt_len, out=torch.zeros(layout.prompt_len, width))
        n1 = fetches()
        b = split.fetch(layout.items, 0, layout.prompt_len, out=torch.zeros(layout.prompt_len, width))
        assert (n1 - n0, fetches() - n1) == (1, 4)
        assert a.segments == b.segments == plan_chunk(layout.items, 0, layout.prompt_len)
        assert torch.equal(a.rows, b.rows) and (a.dtype, a.layout) == (b.dtype, b.layout)
        assert client_base.split_points(0, 10, None, 4) == [(0, 10)]  # nothing to split a packed answer into


def test_pickup_tickets_work_once_and_need_the_credentials(auth_service):
    """The ticket a gRPC Fetch answers: one claim over HTTP, with the call's bearer token."""
    import grpc

    from encoder_service.protocol.proto import encoder_pb2 as pb
    from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc
    from tests.support.service import AUTH_TOKEN

    auth = {"authorization": f"Bearer {AUTH_TOKEN}"}
    with EncoderClient.grpc(auth_service.grpc_address, token=AUTH_TOKEN, timeout=30) as c:
        (info,) = c.encode([png(64, 64, 49)], wait=True, return_embeddings=True)
    with grpc.insecure_channel(auth_service.grpc_address) as channel:
        request = pb.FetchRequest(items=[pb.FetchItem(id=info.id, offset=0)], start=0, end=info.num_tokens,
                                  pickup=True)
        (message,) = list(pb_grpc.EncoderStub(channel).Fetch(request, metadata=tuple(auth.items()), timeout=30))
    token, port = message.header.pickup_token, message.header.pickup_port
    assert token and port == int(auth_service.url.rsplit(":", 1)[1])
    url = auth_service.url + "/v1/fetch/pickup"
    assert httpx.post(url, json={"token": token}).status_code == 401  # the ticket alone is not enough
    first = httpx.post(url, json={"token": token}, headers=auth)
    assert first.status_code == 200, first.text
    from encoder_service.protocol import wire

    assert torch.equal(wire.decode_http(first.content)[1], info.embedding)
    again = httpx.post(url, json={"token": token}, headers=auth)
    assert again.status_code == 404 and "works once" in again.json()["error"]["message"]
    assert httpx.post(url, json={"token": "x" * 43}, headers=auth).status_code == 404


def test_a_failed_pickup_falls_back_to_the_stream(service_qwen3):
    """An HTTP port the client can't reach (here: closed): the rows come on the stream, pickups stop."""
    from encoder_service.rowpath.raw_http import RawHttp
    from tests.support.ports import free_port

    with EncoderClient.grpc(service_qwen3.grpc_address, timeout=30) as c:
        (info,) = c.encode([png(64, 96, 50)], wait=True, return_embeddings=True)
        pickups = c._transport._pickups
        port = int(service_qwen3.url.rsplit(":", 1)[1])
        pickups._raw[port] = RawHttp("127.0.0.1", free_port(), "", {})  # where the pickups will go
        got = c.fetch([(info.id, 0)], 0, info.num_tokens)
        assert torch.equal(got.rows, info.embedding) and not pickups.enabled
        assert torch.equal(c.fetch([(info.id, 0)], 0, info.num_tokens).rows, info.embedding)


async def test_rows_stream_when_too_many_wait_for_pickup(service_qwen3, monkeypatch):
    from encoder_service.api import pickup

    monkeypatch.setattr(pickup.Pickups, "put", lambda self, header, rows: None)  # always full
    async with AsyncEncoderClient.grpc(service_qwen3.grpc_address, timeout=30) as c:
        (info,) = await c.encode([png(64, 32, 51)], wait=True, return_embeddings=True)
        before = _pickups(service_qwen3)
        assert torch.equal((await c.fetch([(info.id, 0)], 0, info.num_tokens)).rows, info.embedding)
        assert _pickups(service_qwen3) == before and c._transport._pickups.enabled


def test_data_messages_follow_the_clients_limit(service_qwen3, monkeypatch):
    """FetchRequest.max_message_bytes: 0 keeps the server's size; more lets data messages grow to it."""
    import grpc

    from encoder_service.api import grpc_server
    from encoder_service.protocol import wire
    from encoder_service.protocol.proto import encoder_pb2 as pb

    monkeypatch.setattr(grpc_server, "FETCH_DATA_BYTES", 1000)
    with EncoderClient.grpc(service_qwen3.grpc_address, timeout=30) as c:
        (info,) = c.encode([png(96, 96, 52)], wait=True, return_embeddings=True)
    with grpc.insecure_channel(service_qwen3.grpc_address) as channel:
        fetch = channel.unary_stream("/encoder.v1.Encoder/Fetch", request_serializer=pb.FetchRequest.SerializeToString)
        for asked, largest in ((0, 1000), (3000, 3000 - wire.GRPC_FRAMING_BYTES)):
            request = pb.FetchRequest(items=[pb.FetchItem(id=info.id, offset=0)], start=0, end=info.num_tokens,
                                      max_message_bytes=asked)
            header, *data = list(fetch(request, timeout=30))
            pieces = [wire.grpc_data_view(m) for m in data]
            assert max(map(len, pieces)) == largest and len(pieces[0]) == largest
            assert b"".join(pieces) == bytes(wire.row_bytes(info.embedding))


@pytest.mark.parametrize("path", ["http raw", "grpc pickup"])
def test_a_wrong_out_is_the_callers_error_and_the_fast_path_stays(service_qwen3, path):
    from encoder_service.protocol.wire import WireError

    with _client(service_qwen3, path, False, None) as c:
        (info,) = c.encode([png(64, 64, 53)], wait=True, return_embeddings=True)
        with pytest.raises(WireError, match="out must be"):
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=torch.zeros(info.num_tokens, info.row_width + 1))
        before = _pickups(service_qwen3)
        assert torch.equal(c.fetch([(info.id, 0)], 0, info.num_tokens).rows, info.embedding)
        _check_path(c, service_qwen3, path, before)
