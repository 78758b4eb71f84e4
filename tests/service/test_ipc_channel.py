"""The same-host channel of the fetch by IPC (protocol/ipc_channel.py, api/ipc_channel.py, client/ipc_channel.py)
against the real server, with the device row arena on the host stand-in (encoder_service/testing/host_ipc.py):

  - with an arena, the server listens on a Unix socket (0600, in a directory of its uid's alone) and says where
    in /v1/metadata; a client's fetches by IPC (blocking and asyncio) and their acknowledgements go over it,
    not HTTP, with the rows bit for bit the socket fetch's;
  - a connection without the token, or with a wrong one, is refused (ERROR, closed): the client fetches over
    HTTP, saying why once; a socket that is gone, the same; frames that are not frames close the connection,
    and the server serves on;
  - a restarted server: the client connects again;
  - bounds: connections past the limit are closed, a HELLO not sent in time ends its connection;
  - the server: a HELLO over MAX_HELLO, or an ACK of more than MAX_ACK_TOKENS, closes the connection; a
    connection of another uid is closed; a path another live channel listens on is not taken (a stale socket
    is), nor removed at stop; stop lets the fetches in flight end, taking no new ones;
  - the client: a fetch the channel can't carry goes over HTTP (its 400), leaving nothing behind; answers
    come in while a send waits for a server that reads no more; a closed link closes its socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import threading
import time

import pytest
import torch

from encoder_service import errors
from encoder_service.api import ipc_channel as server
from encoder_service.api.service import bind_socket
from encoder_service.client import AsyncEncoderClient, EncoderClient
from encoder_service.client.ipc_channel import ChannelLink, _Connection
from encoder_service.protocol import ipc_channel as proto
from encoder_service.protocol.ipc import MAX_ACK_TOKENS, IpcRequest, IpcUnavailable, this_host
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
    link = ChannelLink("wrong-token", lambda timeout: meta)
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


def link_of(c: EncoderClient) -> ChannelLink:
    return c._transport._transport._transport._channel  # (Retrying, OwnerRouting, HttpTransport)


@pytest.mark.parametrize("uncarried", [
    lambda info: [("u:" + "x" * 70000, 0)],  # an id over a frame's strings (64 KiB)
    lambda info: [(info.id, 1 << 63)],  # a position outside int64
])
def test_a_fetch_the_channel_cannot_carry_goes_over_http(svc, standin_dir, uncarried):
    """Before: the frame's error (ChannelError, struct.error) escaped raw, its request left waiting forever."""
    info, _ = encoded(svc, 97)
    with client(svc, standin_dir) as c:
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))  # connected
        with pytest.raises(errors.InvalidInput):
            c.fetch(uncarried(info), 0, 4, out=nan_out(4, info.row_width))
        conn = link_of(c)._conn
        assert conn.alive and not conn._pending


def test_answers_come_in_while_a_send_waits_for_the_server(tmp_path):
    """Before: a send blocked on a server that reads no more (its MAX_IN_FLIGHT) held the lock its reader
    thread needs to hand out answers, so no answer came in until the send ended."""
    path = str(tmp_path / "c.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    state = {}
    first_read, answer_now = threading.Event(), threading.Event()

    def serve():  # HELLO, one FETCH read, then nothing read: the answer to it only
        sock, _ = listener.accept()
        state["sock"] = sock
        f = sock.makefile("rb")
        for _ in range(2):
            n, _, request_id = proto.read_prefix(f.read(proto.PREFIX.size))
            f.read(n)
            if request_id == 0:
                sock.sendall(proto.frame(proto.HELLO, 0))
        first_read.set()
        answer_now.wait(30)
        sock.sendall(proto.unplaced(request_id, IpcUnavailable("held up", None)))

    threading.Thread(target=serve, daemon=True).start()
    conn = _Connection(path, None)
    got = {}

    def call(key: str, items) -> None:
        make = lambda rid: proto.fetch_request(rid, items, 0, 1, None, True, ())  # noqa: E731
        try:
            got[key] = conn.call(make, 20)
        except Exception as exc:  # noqa: BLE001 - recorded
            got[key] = exc

    small = threading.Thread(target=call, args=("small", [("u:a", 0)]), daemon=True)
    small.start()
    assert first_read.wait(10)
    big = threading.Thread(target=call, args=("big", [("u:" + "x" * 60000, 0)] * 16), daemon=True)
    big.start()  # ~1 MiB, more than the socket buffers: its send waits for the server to read

    def unread() -> bool:
        try:
            return len(state["sock"].recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)) > 0
        except BlockingIOError:
            return False

    wait_for(unread, "the big frame on its way", 10)
    answer_now.set()
    small.join(10)
    try:
        assert got.get("small", (None,))[0] == proto.UNPLACED
    finally:
        conn.close()
        big.join(10)
        state["sock"].close()
        listener.close()


def test_a_closed_link_closes_its_socket(svc, standin_dir):
    """Before: the reading file made from the socket kept its descriptor open after close."""
    info, _ = encoded(svc, 98)
    with client(svc, standin_dir) as c:
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
        conn = link_of(c)._conn
        fd = conn._sock.fileno()
        inode = os.fstat(fd).st_ino
    try:
        assert os.fstat(fd).st_ino != inode  # (the number taken again by another file)
    except OSError:
        pass  # closed


def test_a_hello_over_its_bound_closes_the_connection(svc):
    """Before: a HELLO of up to 1 MiB was read before the token was checked, and answered."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(svc.core.ipc.channel)
        s.sendall(proto.hello("t" * 5000))
        assert s.recv(1) == b""  # closed, nothing answered


def test_an_ack_of_too_many_tokens_closes_the_connection(svc):
    """Before: an ACK frame of up to 65535 tokens was taken (a fetch's are bounded by MAX_ACK_TOKENS)."""
    too_many = proto.frame(proto.ACK, 0, struct.pack("<H", MAX_ACK_TOKENS + 1) + bytes(16 * (MAX_ACK_TOKENS + 1)))
    fetch = proto.fetch_request(1, [("u:nobody", 0)], 0, 4, 1.0, True, ())
    assert frames_after(svc.core.ipc.channel, too_many + fetch) == []  # closed: the fetch after it not answered


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # one another uid may run


@pytest.mark.skipif(os.getuid() != 0 or SYSTEM_PYTHON is None, reason="connects as another uid (root only)")
def test_a_connection_of_another_uid_is_closed(tmp_path):
    """As before the socket's chmod (an explicit path in a shared directory): another uid connects. Before: its
    HELLO was answered."""
    directory = tempfile.mkdtemp(prefix="encoder-channel-")
    os.chmod(directory, 0o755)
    channel = server.IpcChannel(None, os.path.join(directory, "c.sock"), None)

    async def go() -> str:
        assert await channel.start()
        try:
            os.chmod(channel.path, 0o666)  # the window before the chmod to 0600
            probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(10)\n"
                     "s.connect(sys.argv[1])\ntry:\n    s.sendall(bytes.fromhex(sys.argv[2]))\n"
                     "    print(s.recv(64).hex())\nexcept (BrokenPipeError, ConnectionResetError):\n    print()")
            done = await asyncio.to_thread(subprocess.run, [SYSTEM_PYTHON, "-I", "-S", "-c", probe, channel.path,
                                                            proto.hello(None).hex()],
                                           capture_output=True, text=True, timeout=20, user=65534, group=65534)
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()
        finally:
            await channel.stop()
            shutil.rmtree(directory, ignore_errors=True)

    assert asyncio.run(go()) == ""  # closed, nothing answered


async def test_a_live_channel_at_the_path_is_not_taken_and_a_stale_one_is(tmp_path):
    """Before: the second channel unlinked the first's live socket and listened in its place; its stop() then
    removed whatever socket was at the path."""
    path = str(tmp_path / "c.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the socket file of a process gone
    first, second = server.IpcChannel(None, path, None), server.IpcChannel(None, path, None)
    assert await first.start()  # the stale one replaced
    try:
        assert not await second.start()
        await second.stop()
        reader, writer = await asyncio.open_unix_connection(path)  # the first's, still there
        writer.write(proto.hello(None))
        assert (await asyncio.wait_for(reader.readexactly(proto.PREFIX.size), 10))[4] == proto.HELLO
        writer.close()
    finally:
        await first.stop()
    assert not os.path.exists(path)


async def test_stop_leaves_a_socket_that_is_not_its_own(tmp_path):
    path = str(tmp_path / "c.sock")
    channel = server.IpcChannel(None, path, None)
    assert await channel.start()
    os.unlink(path)
    other = socket.socket(socket.AF_UNIX)  # another process's, at the path since
    other.bind(path)
    try:
        await channel.stop()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        other.close()


def test_auto_names_the_socket_for_the_http_host_and_port():
    names = {server.channel_path("auto", host, 8000, True) for host in ("127.0.0.1", "127.0.0.2", "::1")}
    assert len(names) == 3 and server.channel_path("auto", "127.0.0.1", 8000, False) is None


def test_stop_lets_fetches_in_flight_end_and_takes_no_new_one(svc, standin_dir, monkeypatch):
    """Before: stop() closed every connection at once, cutting the fetches in flight (and the channel went on
    taking fetches through HTTP's graceful shutdown)."""
    info, _ = encoded(svc, 99)
    gate = svc.call(_event)
    real_fetch = svc.core.fetch

    async def held_back(*args, **kw):  # the real fetch, once the test lets it go
        await gate.wait()
        return await real_fetch(*args, **kw)

    monkeypatch.setattr(svc.core, "fetch", held_back)
    channel = server.IpcChannel(svc.core, str(standin_dir / "graceful.sock"), None)
    assert svc.call(channel.start)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(channel.path)
        s.sendall(proto.hello(None) + proto.fetch_request(5, [(info.id, 0)], 0, info.num_tokens, 10.0, False, ()))
        f = s.makefile("rb")
        assert proto.read_prefix(f.read(proto.PREFIX.size))[1] == proto.HELLO
        wait_for(lambda: channel._fetches, "the fetch in flight", 10)
        stopping = threading.Thread(target=svc.call, args=(channel.stop, 20.0), daemon=True)
        stopping.start()
        wait_for(lambda: channel._stopping, "the stop begun", 10)
        with socket.socket(socket.AF_UNIX) as late, pytest.raises(OSError):
            late.connect(channel.path)  # no new connection
        svc.loop.call_soon_threadsafe(gate.set)
        n, kind, request_id = proto.read_prefix(f.read(proto.PREFIX.size))
        assert (kind, request_id) == (proto.PLACED, 5)  # answered, not cut
        f.read(n)
        stopping.join(20)
        assert not stopping.is_alive() and not os.path.exists(channel.path)


async def _event() -> asyncio.Event:
    return asyncio.Event()
