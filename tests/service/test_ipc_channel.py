"""The same-host channel of the fetch by IPC (protocol/ipc_channel.py, api/ipc_channel.py, client/ipc_channel.py)
against the real server, with the device row arena on the host stand-in (encoder_service/testing/host_ipc.py):

  - with an arena, the server listens on a Unix socket (0600, in a directory of its uid's alone) and says where
    in /v1/metadata; a client's fetches by IPC (blocking and asyncio) and their acknowledgements go over it,
    not HTTP, with the rows bit for bit the socket fetch's;
  - a connection without the token, or with a wrong one, is refused (ERROR, closed): the client fetches over
    HTTP, saying why once; a socket that is gone, the same; frames that are not frames close the connection,
    and the server serves on;
  - a restarted server: the client connects again;
  - bounds: connections past the limit are closed, a HELLO not sent in time ends its connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
import os
import socket
import stat
import struct

import pytest
import torch

from encoder_service.api import ipc_channel as server
from encoder_service.api.service import bind_socket
from encoder_service.client import AsyncEncoderClient, EncoderClient
from encoder_service.client.ipc_channel import ChannelLink
from encoder_service.protocol import ipc_channel as proto
from encoder_service.protocol.ipc import IpcRequest, this_host
from encoder_service.testing.host_ipc import HostStandInReader
from tests.service.test_ipc_fetch import ipc_service, nan_out
from tests.support.images import image_bytes as png
from tests.support.service import AUTH_TOKEN
from tests.support.waits import async_wait_for, wait_for

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("channel")


@pytest.fixture(scope="module")
def svc(request, tiny_checkpoint, standin_dir):
    service = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, "--auth-token", AUTH_TOKEN)
    request.addfinalizer(service.close)
    return service


def fetches(svc, transport: str) -> float:
    return svc.sample("encoder_requests_total", {"transport": transport, "method": "fetch", "outcome": "ok"})


def client(svc, directory, **kw) -> EncoderClient:
    return EncoderClient.http(svc.url, token=AUTH_TOKEN, timeout=WAIT_S, ipc=HostStandInReader(str(directory)), **kw)


def encoded(svc, seed: int):
    with EncoderClient.http(svc.url, token=AUTH_TOKEN, timeout=WAIT_S, ipc="off") as w:
        (info,) = w.encode([png(112, 112, seed)], wait=True)
        return info, w.fetch([(info.id, 0)], 0, info.num_tokens).rows


def test_the_channel_is_a_private_socket_named_in_the_metadata(svc):
    path = svc.core.metadata()["ipc"]["channel"]
    assert path and stat.S_ISSOCK(os.lstat(path).st_mode) and os.lstat(path).st_mode & 0o777 == 0o600
    parent = os.lstat(os.path.dirname(path))
    assert parent.st_uid == os.getuid() and parent.st_mode & 0o077 == 0


def test_fetches_by_ipc_and_their_acks_go_over_the_channel(svc, standin_dir):
    info, reference = encoded(svc, 91)
    http0, channel0 = fetches(svc, "http"), fetches(svc, "channel")
    with client(svc, standin_dir) as c:
        outs = [nan_out(info.num_tokens, info.row_width) for _ in range(3)]
        for out in outs:
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
        assert c.fetch_paths == {"ipc": 3}
    assert all(torch.equal(out, reference) for out in outs)
    assert (fetches(svc, "http") - http0, fetches(svc, "channel") - channel0) == (0, 3)
    wait_for(lambda: svc.sample("encoder_ipc_arena_holds") == 0, "every hold acknowledged", WAIT_S)
    assert svc.sample("encoder_requests_total", {"transport": "http", "method": "ack", "outcome": "ok"}) == 0


def test_the_async_client_fetches_over_the_channel(svc, standin_dir):
    info, reference = encoded(svc, 92)
    channel0 = fetches(svc, "channel")

    async def go():
        async with AsyncEncoderClient.http(svc.url, token=AUTH_TOKEN, timeout=WAIT_S,
                                           ipc=HostStandInReader(str(standin_dir))) as c:
            outs = [nan_out(info.num_tokens, info.row_width) for _ in range(8)]
            await asyncio.gather(*(c.fetch([(info.id, 0)], 0, info.num_tokens, out=out) for out in outs))
            return outs, dict(c.fetch_paths)

    outs, paths = asyncio.run(go())
    assert paths == {"ipc": 8} and all(torch.equal(out, reference) for out in outs)
    assert fetches(svc, "channel") - channel0 == 8  # several in flight on one connection


def hello_answer(path: str, token: str | None) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(proto.hello(token))
        f = s.makefile("rb")
        length, kind, _ = proto.PREFIX.unpack(f.read(proto.PREFIX.size))
        body = f.read(length - 5)
        assert kind == proto.HELLO or f.read(1) == b""  # refused: closed after the ERROR
        return kind, body


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_connection_without_the_token_is_refused(svc, token):
    kind, body = hello_answer(svc.core.ipc.channel, token)
    assert kind == proto.ERROR and proto.read_error(body)[0] == "unauthenticated"
    assert hello_answer(svc.core.ipc.channel, AUTH_TOKEN)[0] == proto.HELLO


def test_a_refused_channel_sends_the_fetch_over_http_and_says_so_once(svc, caplog):
    info, _ = encoded(svc, 93)
    meta = svc.core.metadata()
    link = ChannelLink("wrong-token", lambda: meta)
    request = IpcRequest(this_host()).to_dict()
    with caplog.at_level(logging.INFO, "encoder_service.client"):
        assert link.fetch([(info.id, 0)], 0, info.num_tokens, request, WAIT_S) is None
        assert link.fetch([(info.id, 0)], 0, info.num_tokens, request, WAIT_S) is None  # not asked again
    assert len([r for r in caplog.records if "IPC channel refused" in r.message]) == 1
    link.close()


def frames_after(path: str, data: bytes) -> list[tuple[int, bytes]]:
    """The frames the server answers `data` with (after the HELLO's), until it closes or answers once more."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(proto.hello(AUTH_TOKEN) + data)
        f, got = s.makefile("rb"), []
        while len(got) < 2 and len(prefix := f.read(proto.PREFIX.size)) == proto.PREFIX.size:
            length, kind, _ = proto.PREFIX.unpack(prefix)
            got.append((kind, f.read(length - 5)))
        return got[1:]


@pytest.mark.parametrize("junk", [
    struct.pack("<IBI", 1 << 30, proto.FETCH, 1),  # a frame over the limit
    proto.frame(77, 1),  # no such frame type
    proto.frame(proto.PLACED, 1),  # an answer, from a consumer
])
def test_junk_closes_the_connection_and_the_server_serves_on(svc, standin_dir, junk):
    assert frames_after(svc.core.ipc.channel, junk) == []  # closed, nothing answered
    info, reference = encoded(svc, 94)
    with client(svc, standin_dir) as c:
        out = nan_out(info.num_tokens, info.row_width)
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("body, says", [
    (b"\x01\x02", "shorter than its fields"),
    (struct.pack("<qqdBHH", 0, 4, 1.0, 1, 0, 1) + struct.pack("<qH", 0, 2) + b"\xff\xfe", "UTF-8"),
])
def test_a_malformed_fetch_is_a_4xx_naming_the_problem(svc, body, says):
    ((kind, answer),) = frames_after(svc.core.ipc.channel, proto.frame(proto.FETCH, 7, body))
    error_kind, message = proto.read_error(answer)
    assert kind == proto.ERROR and error_kind == "invalid_input" and says in message


def test_a_socket_that_is_gone_sends_fetches_over_http(tiny_checkpoint, standin_dir, caplog):
    alone = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir)
    try:
        os.unlink(alone.core.ipc.channel)  # listening still, but nobody can reach it by its path
        info, reference = encoded(alone, 95)
        with EncoderClient.http(alone.url, timeout=WAIT_S, ipc=HostStandInReader(str(standin_dir))) as c, \
                caplog.at_level(logging.INFO, "encoder_service.client"):
            out = nan_out(info.num_tokens, info.row_width)
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
            assert c.fetch_paths == {"ipc": 1}
        assert torch.equal(out, reference) and fetches(alone, "http") >= 1 and fetches(alone, "channel") == 0
        assert any("IPC channel: " in r.message and "over HTTP" in r.message for r in caplog.records)
    finally:
        alone.close()


def test_a_restarted_server_is_connected_to_again(tiny_checkpoint, standin_dir):
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    first = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, http_sock=sock)
    path = first.core.ipc.channel
    with EncoderClient.http(first.url, timeout=WAIT_S, ipc=HostStandInReader(str(standin_dir))) as c:
        try:
            (info,) = c.encode([png(112, 112, 96)], wait=True)
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
            assert fetches(first, "channel") == 1
        finally:
            first.close()
        second = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, http_sock=bind_socket("127.0.0.1", port))
        try:
            assert second.core.ipc.channel == path  # named for the port
            (info,) = c.encode([png(112, 112, 96)], wait=True)

            def over_the_channel() -> bool:
                c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
                return fetches(second, "channel") >= 1

            wait_for(over_the_channel, "a fetch over the new server's channel", WAIT_S, poll_s=0.2)
            assert c.fetch_paths["ipc"] >= 2 and c.fetch_paths.get("socket", 0) == 0
        finally:
            second.close()


async def test_connections_past_the_limit_are_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "HELLO_TIMEOUT_S", 0.5)
    channel = server.IpcChannel(None, str(tmp_path / "c.sock"), None, max_connections=1)
    assert await channel.start()
    try:
        r1, w1 = await asyncio.open_unix_connection(channel.path)
        w1.write(proto.hello(None))
        assert (await r1.readexactly(proto.PREFIX.size))[4] == proto.HELLO
        r2, w2 = await asyncio.open_unix_connection(channel.path)  # one too many: closed, nothing answered
        assert await asyncio.wait_for(r2.read(), 10) == b""
        w1.close()
        await async_wait_for(lambda: not channel._connections, "the connections ended", 10)
        r3, w3 = await asyncio.open_unix_connection(channel.path)
        t0 = time.monotonic()
        assert await asyncio.wait_for(r3.read(), 10) == b""  # no HELLO within HELLO_TIMEOUT_S: closed
        assert time.monotonic() - t0 >= 0.4
        for w in (w2, w3):
            w.close()
    finally:
        await channel.stop()
