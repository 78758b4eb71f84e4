"""Fetched rows written by pool threads on the connection's socket (api/socket_send.py): the same bytes as the
encode's own rows on every HTTP-carried path, on a kept-alive connection too; a client that stops reading
holds one thread and nothing else, until it leaves or the send times out; `--send-threads 0` is the loop path;
a JSON answer leaves in one write.

The rows are a Qwen3-VL-shaped checkpoint's (tests/support/vision_checkpoints.py: a tiny tower, rows 4096 x 4
bf16 = 32 KiB): a 640x360 JPEG's entry is 440 rows, 14.4 MB, over MIN_BYTES and over what loopback socket buffers
hold."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket

import pytest

from encoder_service.api import socket_send, uvicorn_internals
from encoder_service.client import EncoderClient
from encoder_service.protocol import wire
from tests.support.images import image_bytes
from tests.support.service import running
from tests.support.vision_checkpoints import build_wide_rows
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(180)


class SendSpy:
    """Wraps the real `_sendall`: counts the thread writes that start and how each ended."""

    def __init__(self, real):
        self.real, self.started, self.ended = real, [], []  # list.append is atomic: no lock

    def __call__(self, fd: int, rows: memoryview) -> None:
        self.started.append(len(rows))
        try:
            self.real(fd, rows)
        except OSError as e:
            self.ended.append(e)
            raise
        self.ended.append(None)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wide-rows")
    build_wide_rows(directory, 4096)
    return directory


@pytest.fixture
def spy(monkeypatch) -> SendSpy:
    s = SendSpy(socket_send._sendall)
    monkeypatch.setattr(socket_send, "_sendall", s)
    return s


def _encode(svc, seed: int):
    with EncoderClient.http(svc.url, timeout=60) as c:
        (info,) = c.encode([image_bytes(640, 360, seed, "JPEG")], wait=True, return_embeddings=True)
    return info


def _fetch_json(info) -> bytes:
    return json.dumps({"items": [{"id": info.id, "offset": 0}], "start": 0, "end": info.num_tokens}).encode()


def test_uvicorn_serves_with_httptools_and_the_cycle_has_what_the_writer_uses():
    """httptools is a dependency; a uvicorn release that renamed what the writer reads of its request cycle
    (api/uvicorn_internals.py: RequestCycle) fails here, not silently."""
    assert uvicorn_internals.httptools_cycle_type() is not None


def test_rows_written_by_threads_equal_the_encodes_on_every_http_path(request, wide_checkpoint, spy):
    svc = running(request, wide_checkpoint, "--send-threads", "2", "--max-pixels", "20000000")
    assert svc.service.threaded_sends
    info = _encode(svc, seed=1)
    want = wire.row_bytes(info.embedding)
    assert len(want) > socket_send.MIN_BYTES
    with EncoderClient.http(svc.url, timeout=60) as c:
        got_http = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
    with EncoderClient.grpc(svc.grpc_address, timeout=60) as c:  # the rows picked up over HTTP
        got_grpc = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
    for got in (got_http, got_grpc):
        assert bytes(wire.row_bytes(got)) == bytes(want)
    assert len(spy.started) == 2 and spy.ended == [None, None]

    # One kept-alive connection: two fetches, then a small request, each answer whole.
    host, port = svc.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        for _ in range(2):
            conn.request("POST", "/v1/fetch", body=_fetch_json(info), headers={"content-type": "application/json"})
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200 and len(body) == int(resp.headers["content-length"])
            assert body[-len(want):] == bytes(want)
        conn.request("GET", "/health/ready")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert len(spy.started) == 4


def test_send_threads_zero_is_the_loop_path(request, wide_checkpoint, spy):
    svc = running(request, wide_checkpoint, "--send-threads", "0", "--max-pixels", "20000000")
    assert not svc.service.threaded_sends
    info = _encode(svc, seed=2)
    with EncoderClient.http(svc.url, timeout=60) as c:
        got = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
    assert bytes(wire.row_bytes(got)) == bytes(wire.row_bytes(info.embedding))
    assert spy.started == []


def _stalled_fetch(svc, info) -> socket.socket:
    """A client that sends a fetch, then reads only the status line: the rows stop in the socket buffers."""
    host, port = svc.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = _fetch_json(info)
    sock.sendall(b"POST /v1/fetch HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    assert sock.recv(12).startswith(b"HTTP/1.1 200")
    return sock


def test_a_client_that_stops_reading_holds_one_thread_until_it_leaves_or_times_out(
        request, wide_checkpoint, spy, monkeypatch):
    svc = running(request, wide_checkpoint, "--send-threads", "1", "--max-pixels", "20000000")
    info = _encode(svc, seed=3)
    want = bytes(wire.row_bytes(info.embedding))

    def fetch_ok() -> bool:
        with EncoderClient.http(svc.url, timeout=30) as c:
            return bytes(wire.row_bytes(c.fetch([(info.id, 0)], 0, info.num_tokens).rows)) == want

    def thread_fetch_again(started: int) -> None:
        """The thread is free once the loop has seen its error: a later fetch is written by it, whole."""
        wait_for(lambda: fetch_ok() and len(spy.started) > started, "a fetch written by the thread again")
        wait_for(lambda: len(spy.ended) == len(spy.started), "that write to end")
        assert spy.ended[started:] == [None] * (len(spy.started) - started)

    # 1. It leaves: the thread's send fails, the thread is free again, the service serves on.
    stalled = _stalled_fetch(svc, info)
    wait_for(lambda: len(spy.started) == 1, "the stalled fetch's rows in the send thread")
    assert fetch_ok()  # the only thread is busy: this one went through the loop
    assert len(spy.started) == 1 and spy.ended == []
    stalled.close()  # unread bytes in its buffer: the kernel resets the connection
    wait_for(lambda: len(spy.ended) == 1, "the send thread to see the client gone")
    assert isinstance(spy.ended[0], OSError)
    thread_fetch_again(1)

    # 2. It stays but never reads: the send gives up after SEND_TIMEOUT_S and closes the connection.
    monkeypatch.setattr(socket_send, "SEND_TIMEOUT_S", 1.0)
    n = len(spy.started)
    stalled = _stalled_fetch(svc, info)
    try:
        wait_for(lambda: len(spy.ended) == n + 1, "the send to time out")
        assert isinstance(spy.ended[-1], TimeoutError)
        monkeypatch.setattr(socket_send, "SEND_TIMEOUT_S", 60.0)  # the next fetches may be slow on a loaded box
        thread_fetch_again(len(spy.started))
        stalled.settimeout(30)
        with contextlib.suppress(ConnectionResetError):  # what was sent, then the end: the server closed it
            for _ in range(len(want) // 4096 + 10):
                if not stalled.recv(1 << 20):
                    break
            else:
                pytest.fail("the timed-out connection is still open")
    finally:
        stalled.close()


def test_free_threads_queue_waiters_in_order_time_them_out_and_never_lose_a_thread():
    import asyncio

    async def main():
        free = socket_send.FreeThreads(1)
        assert await free.take(0.01)  # the only thread
        assert not await free.take(0.01)  # none came back in time: the loop path
        first = asyncio.ensure_future(free.take(5))
        second = asyncio.ensure_future(free.take(5))
        await asyncio.sleep(0)
        free.give()  # to the first in line
        assert await first and not second.done()
        free.give()
        assert await second
        # A waiter cancelled just as its thread came gives it back: the next take finds it at once.
        third = asyncio.ensure_future(free.take(5))
        await asyncio.sleep(0)
        free.give()
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third
        assert await free.take(0) and not await free.take(0.01)

    asyncio.run(main())


class Recording:
    """A transport that records what is written to it."""

    def __init__(self, transport, log: list[bytes]):
        self._transport, self.log = transport, log

    def write(self, data) -> None:
        self.log.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class WritesSpy:
    """What each response's held transport (api/socket_send.py: _HeadWithBody) hands the real one."""

    def __init__(self):
        self.writes: list[list[bytes]] = []
        spy = self

        class Held(socket_send._HeadWithBody):
            def __init__(self, transport):
                spy.writes.append([])
                super().__init__(Recording(transport, spy.writes[-1]))

        self.held = Held


def test_a_json_answer_leaves_in_one_write_and_rows_answers_do_not_wait(request, wide_checkpoint, monkeypatch, spy):
    """An error and a success answered as JSON go out whole (status line, headers and body in one transport
    write); a large JSON body follows its headers without being joined to them; a rows answer keeps its
    headers-first path (its rows are written by a thread after them)."""
    writes = WritesSpy()
    monkeypatch.setattr(socket_send, "_HeadWithBody", writes.held)
    svc = running(request, wide_checkpoint, "--send-threads", "2", "--max-pixels", "20000000")
    host, port = svc.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        for body, status in ((b'{"tokens": []}', 200), (b'{"tokens": 3}', 400)):
            conn.request("POST", "/v1/fetch/ack", body=body, headers={"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == status and json.loads(resp.read())
        assert [len(w) for w in writes.writes] == [1, 1]
        for (whole,) in writes.writes:
            head, _, body = whole.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 ") and json.loads(body)
        info = _encode(svc, seed=3)  # its JSON carries the embeddings: over WHOLE_MAX_BYTES, not joined (copied)
        head, body = writes.writes[-1]
        assert head.startswith(b"HTTP/1.1 200") and len(body) > socket_send.WHOLE_MAX_BYTES
        answers = len(writes.writes)
        conn.request("POST", "/v1/fetch", body=_fetch_json(info), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and len(resp.read()) == int(resp.headers["content-length"])
        wait_for(lambda: spy.ended == [None], "the thread's write to end", 10)  # (it ends after the client read)
        assert len(writes.writes) == answers  # no held head: the rows went by the thread
    finally:
        conn.close()
