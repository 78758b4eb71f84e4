"""The raw-socket HTTP fetch reader (rowpath/raw_http.py) against scripted servers: what our server never
sends (chunked bodies, huge heads, short bodies, stale keep-alive sockets, stalls) must end in a clear error
or the httpx path, never in wrong rows or a hang."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import torch

from encoder_service import errors
from encoder_service.client.destination import Destination, StagingBuffers
from encoder_service.client.http import HttpTransport
from encoder_service.protocol import wire
from encoder_service.ranges import Segment
from encoder_service.rowpath.host_pool import HostRowPool
from encoder_service.rowpath.raw_http import Cancel, NotRaw, RawHttp, read_fetch

pytestmark = pytest.mark.timeout(60)

ROWS = torch.arange(24, dtype=torch.float32).view(6, 4)
HEADER = wire.WireHeader("float32", 4, "main", (Segment("a", 0, 0, 6),))


def payload() -> bytes:
    prefix, data = wire.http_parts(HEADER, ROWS)
    return prefix + bytes(data)


def answer(body: bytes, status: str = "200 OK", ctype: str = "application/octet-stream", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


def chunked(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")


class ScriptedServer:
    """127.0.0.1; per accepted connection, `script(conn, requests)`: requests is an iterator of raw requests."""

    def __init__(self, script):
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.connections = 0
        self._script = script
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn):
        with conn:
            try:
                self._script(conn, _requests(conn))
            except OSError:
                pass

    def close(self):
        self._sock.close()


def _requests(conn):
    """Yields each request (head + body) read from `conn`, until it closes."""
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        head, buf = buf.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(buf) < length:
            data = conn.recv(65536)
            if not data:  # the client closed mid-body
                return
            buf += data
        yield head, buf[:length]
        buf = buf[length:]


@pytest.fixture
def serve(request):
    def start(script) -> ScriptedServer:
        server = ScriptedServer(script)
        request.addfinalizer(server.close)
        return server
    return start


def fetch(raw: RawHttp, out=None, cancel=None):
    dest = Destination(out, 0, StagingBuffers(), HostRowPool())
    header, _ = raw.post("/v1/fetch", b"{}", 10, read_fetch(dest.writer), cancel=cancel)
    return header, dest.finish()


def test_reads_the_payload_and_keeps_the_connection(serve):
    def script(conn, requests):
        for head, body in requests:
            assert head.startswith(b"POST /prefix/v1/fetch HTTP/1.1") and b"authorization: Bearer t" in head
            conn.sendall(answer(payload()))

    server = serve(script)
    raw = RawHttp.for_url(f"http://127.0.0.1:{server.port}/prefix/", {"authorization": "Bearer t"})
    out = torch.zeros(8, 4)
    for _ in range(3):
        header, rows = fetch(raw, out)
        assert header == HEADER and rows is out and torch.equal(out[:6], ROWS)
    assert server.connections == 1  # keep-alive
    raw.close()


def test_a_stale_keep_alive_socket_is_replaced_once(serve):
    def script(conn, requests):  # one answer per connection, then the server closes it
        next(requests)
        conn.sendall(answer(payload()))

    server = serve(script)
    raw = RawHttp.for_url(f"http://127.0.0.1:{server.port}", {})
    for _ in range(3):
        assert torch.equal(fetch(raw)[1], ROWS)
    assert server.connections == 3


def test_errors_are_the_services_types(serve):
    bodies = iter([answer(json.dumps({"error": {"kind": "not_found", "message": "unknown id 'x'"}}).encode(),
                          "404 Not Found", "application/json"),
                   answer(b"<html>bad gateway</html>", "502 Bad Gateway", "text/html"),
                   answer(b"{}", "200 OK", "application/json")])

    def script(conn, requests):
        for _ in requests:
            conn.sendall(next(bodies))

    raw = RawHttp.for_url(f"http://127.0.0.1:{serve(script).port}", {})
    with pytest.raises(errors.NotFound, match="unknown id 'x'"):
        fetch(raw)
    with pytest.raises(errors.EncoderServiceError, match="bad gateway"):
        fetch(raw)
    with pytest.raises(NotRaw, match="application/json"):
        fetch(raw)


@pytest.mark.parametrize("reply, error", [
    (answer(payload())[:-8], wire.WireError),  # the server stops 8 bytes short and closes
    (answer(payload()[:4] + b"\xff" * 4), wire.WireError),  # corrupt header length
    (answer(payload() + b"\0" * 16), wire.WireError),  # Content-Length says more than the header's rows
    (b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 70000 + b"\r\n\r\n", NotRaw),
    (chunked(payload()), NotRaw),
    (b"SSH-2.0-OpenSSH\r\n\r\n", NotRaw),
])
def test_what_our_server_never_sends_is_an_error(serve, reply, error):
    def script(conn, requests):
        next(requests)
        conn.sendall(reply)
        conn.shutdown(socket.SHUT_WR)

    raw = RawHttp.for_url(f"http://127.0.0.1:{serve(script).port}", {})
    out = torch.full((6, 4), -1.0)
    with pytest.raises(error):
        fetch(raw, out)


def test_an_unexpected_answer_turns_the_transport_to_httpx(serve):
    def script(conn, requests):
        for _ in requests:
            conn.sendall(chunked(payload()))

    transport = HttpTransport(f"http://127.0.0.1:{serve(script).port}")
    try:
        for _ in range(2):
            header, rows = transport.fetch([("a", 0)], 0, 6, Destination(None, 0, StagingBuffers(), HostRowPool()), 10)
            assert header == HEADER and torch.equal(rows, ROWS)
            assert transport._raw.raw is None
    finally:
        transport.close()


def test_https_and_proxies_use_httpx(monkeypatch):
    assert RawHttp.for_url("https://127.0.0.1:1", {}) is None
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert RawHttp.for_url("http://encoder.example:80", {}) is None
    assert RawHttp.for_url("http://encoder.example:80", {}, trust_env=False) is not None


def test_cancel_stops_a_stalled_read(serve):
    stalled = threading.Event()

    def script(conn, requests):
        next(requests)
        conn.sendall(answer(payload())[:-40])  # most of it, then nothing
        stalled.set()
        conn.recv(1)  # until the client shuts its side

    raw = RawHttp.for_url(f"http://127.0.0.1:{serve(script).port}", {})
    cancel, failure = Cancel(), []

    def run():
        try:
            fetch(raw, cancel=cancel)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            failure.append(exc)

    reader = threading.Thread(target=run)
    reader.start()
    assert stalled.wait(10)
    cancel.fire()
    reader.join(10)
    assert not reader.is_alive() and isinstance(failure[0], (errors.Unavailable, wire.WireError))


def test_shm_fetch_answers_are_read_on_the_plain_socket_and_httpx_takes_what_it_cannot_read(serve):
    """An shm fetch's JSON header (the rows went into the client's file) is read by the raw reader on a
    kept-alive socket; a chunked answer, which our server never sends, turns the transport to httpx."""
    shm_answer = json.dumps(HEADER.to_dict() | {"shm_bytes": ROWS.numel() * 4}).encode()
    replies = iter([answer(shm_answer, ctype="application/json")] * 2
                   + [answer(shm_answer, ctype="application/json", extra="transfer-encoding: chunked\r\n")])
    heads = []

    def script(conn, requests):
        for head, body in requests:
            heads.append(head)
            assert json.loads(body)["shm"] == {"name": "n", "offset": 0}
            reply = next(replies, None)
            conn.sendall(reply if reply is not None else
                         answer(shm_answer, ctype="application/json"))

    server = serve(script)
    transport = HttpTransport(f"http://127.0.0.1:{server.port}")
    try:
        for _ in range(2):
            assert transport.fetch_shm([("a", 0)], 0, 6, {"name": "n", "offset": 0}, 10) == (HEADER, 96)
        assert transport._raw.raw is not None and server.connections == 1
        assert all(b"accept: application/json" in h for h in heads)
        # The third answer says chunked: not read raw; httpx asks again (a fourth request) and reads it.
        assert transport.fetch_shm([("a", 0)], 0, 6, {"name": "n", "offset": 0}, 10) == (HEADER, 96)
        assert transport._raw.raw is None and len(heads) == 4
    finally:
        transport.close()
