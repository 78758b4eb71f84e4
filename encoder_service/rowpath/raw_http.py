"""Fetch over HTTP/1.1 on a plain socket: the body read straight into the rows' destination.

httpx reads a body in chunks into new bytes objects and joins them, and the rows were then copied once more:
0.5 GB/s on an H100 host whose server sent one curl 3.1 GB/s. Here a fetch is one POST on a keep-alive
socket; the status line, headers and wire header go through a small buffer, then `RowWriter.readinto` hands
the socket's recv_into views of the destination (`out`, a staging buffer or a new tensor): no bytes object
per read, no join, and the GIL is released while the kernel copies, so threads receive in parallel.

Only what our server sends is read here: HTTP/1.1 with a Content-Length body. `RawHttp.for_url` gives None
for anything else it can see up front (https, a proxy from the environment); a response it does not expect
(no Content-Length, chunked) raises NotRaw before any row is read. The transport (client/http.py) then
uses httpx.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request
from typing import Callable, TypeVar
from urllib.parse import urlsplit

from encoder_service.errors import DeadlineExceeded, EncoderServiceError, Unavailable, Unreachable
from encoder_service.protocol import wire
from encoder_service.protocol.errors import remote_error

T = TypeVar("T")
MAX_HEAD_BYTES = 64 << 10  # status line + headers of our answers are a few hundred bytes
MAX_ERROR_BODY_BYTES = 1 << 20  # an error answer's JSON; larger is not ours
MAX_IDLE = 64  # keep-alive sockets kept for reuse (one per fetch in flight is open at a time)
READ_THREADS = 32  # an async transport's threads for these reads (each blocks in recv_into, GIL released)
# A connect's own deadline, within the call's timeout: an address where nothing answers (a host gone, a
# firewall dropping the SYN) fails the try after this, not after the whole call's timeout.
CONNECT_TIMEOUT_S = 5.0
OCTET = "application/octet-stream"
JSON = "application/json"


class NotRaw(Exception):
    """A response this reader does not handle (its rows untouched): ask again with httpx."""


class NoAnswer(DeadlineExceeded):
    """The server did not answer in time: a socket's timeout (the connect, or a read), not an answer of the
    server's (its own 504 is a plain DeadlineExceeded). Frozen, hung, or its packets dropped; or just slow."""


class ConnectTimedOut(Unreachable):
    """No connection within the connect's own deadline: a host that drops packets, or a listener whose backlog
    is full (a frozen server). Unreachable to a client (it tries again); silent to a peer (replicas/peers.py)."""


class Cancel:
    """Lets another thread (the asyncio loop, when a fetch is cancelled) stop a blocking fetch: the socket is
    shut down, so the reader's recv returns and the fetch ends with an error instead of reading on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._fired = False

    def watch(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            if self._fired and sock is not None:
                _shutdown(sock)

    def fire(self) -> None:
        with self._lock:
            self._fired = True
            if self._sock is not None:
                _shutdown(self._sock)

    @property
    def fired(self) -> bool:
        return self._fired


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Response:
    """One response being read: its status, headers (lower-case names) and body length, and readers."""

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str], length: int):
        self._conn, self.status, self.headers, self.length = conn, status, headers, length

    def read_exact(self, n: int) -> bytes:
        return self._conn.read_exact(n)

    def recv_into(self, view: memoryview) -> int:
        return self._conn.recv_into(view)


class _Connection:
    """A socket and the bytes read past what was asked for (a small buffer; rows never pass through it)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(MAX_HEAD_BYTES)
        self._lo = self._hi = 0  # unread bytes: _buf[_lo:_hi]
        self.received_any = False  # any byte of the current answer
        self.reusable = False  # the current answer was read to its end and the server keeps the connection

    def reset(self) -> None:
        """Before the next request on this connection."""
        self.received_any = self.reusable = False

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):  # compact: unread bytes to the front
            self._buf[:self._hi - self._lo] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, self._hi - self._lo
        n = self.sock.recv_into(memoryview(self._buf)[self._hi:])
        if not n:
            raise ConnectionResetError("the server closed the connection")
        self._hi += n
        self.received_any = True

    def read_head(self) -> bytes:
        """Status line and headers, up to the blank line (not included)."""
        while True:
            end = self._buf.find(b"\r\n\r\n", self._lo, self._hi)
            if end >= 0:
                head, self._lo = bytes(self._buf[self._lo:end]), end + 4
                return head
            if self._hi - self._lo >= len(self._buf):
                raise NotRaw(f"response headers over {len(self._buf)} bytes")
            self._fill()

    def read_exact(self, n: int) -> bytes:
        if n > len(self._buf):
            out = bytearray(n)
            view, done = memoryview(out), 0
            while done < n:
                got = self.recv_into(view[done:])
                if not got:
                    raise ConnectionResetError("the server closed the connection mid-answer")
                done += got
            return bytes(out)
        while self._hi - self._lo < n:
            self._fill()
        out, self._lo = bytes(self._buf[self._lo:self._lo + n]), self._lo + n
        return out

    def drained(self) -> bool:
        """Nothing read past the answer (a server never sends ahead of our next request)."""
        return self._lo == self._hi

    def recv_into(self, view: memoryview) -> int:
        if self._lo < self._hi:  # bytes that came with the headers first
            n = min(len(view), self._hi - self._lo)
            view[:n] = self._buf[self._lo:self._lo + n]
            self._lo += n
            return n
        return self.sock.recv_into(view)


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    try:
        lines = head.decode("latin-1").split("\r\n")
        version, status = lines[0].split(" ", 2)[:2]
        headers = {}
        for line in lines[1:]:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        if not version.startswith("HTTP/1."):
            raise ValueError(version)
        return int(status), headers
    except ValueError as exc:
        raise NotRaw(f"not an HTTP/1.x response head: {head[:200]!r}") from exc


def http_error(status: int, headers, body: bytes) -> EncoderServiceError:
    """A non-2xx answer as the service's error type: our JSON error body names it, else the status does."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):  # not our JSON (a proxy's page): the status decides the type
        err = None
    err = err if isinstance(err, dict) else {}
    retry = err.get("retry_after_s")
    if retry is None and headers.get("retry-after") is not None:
        retry = float(headers["retry-after"])
    message = err.get("message") or body[:500].decode("utf-8", "replace")
    return remote_error(err.get("kind"), message, status, retry)


class RawHttp:
    """POSTs to one http:// origin on keep-alive sockets, each response read by a caller-given function.
    Thread-safe: each request has a socket of its own; idle ones are kept (at most MAX_IDLE)."""

    def __init__(self, host: str, port: int, path_prefix: str, headers: dict[str, str],
                 connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self._address = (host, port)
        self._connect_timeout_s = connect_timeout_s  # a connect's own deadline (within the call's timeout)
        self._prefix = path_prefix
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._origin = f"http://{netloc}"
        self._head_lines = "".join(f"{k}: {v}\r\n" for k, v in ({"host": netloc} | headers).items())
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def for_url(cls, base_url: str, headers: dict[str, str], trust_env: bool = True,
                connect_timeout_s: float = CONNECT_TIMEOUT_S) -> RawHttp | None:
        """None unless `base_url` is plain http:// reached without a proxy (httpx's rules: the environment's
        proxies apply unless trust_env is off or NO_PROXY exempts the host)."""
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            return None
        if trust_env and urllib.request.getproxies().get("http") and not urllib.request.proxy_bypass(parts.hostname):
            return None
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/"), headers, connect_timeout_s)

    def post(self, path: str, body: bytes, timeout: float | None, read: Callable[[Response], T],
             accept: str = OCTET, cancel: Cancel | None = None, headers: dict[str, str] | None = None,
             connect_s: float | None = None) -> T:
        """POST `body` (JSON) to `path` and return `read(response)` of a 200 answer, which must read exactly
        its body. `timeout` bounds each socket operation (`connect_s` the connect, when given: a peer that must
        answer at once, replicas/peers.py). `headers`: this request's own, beside the origin's. Other statuses
        raise the service's error type; no connection in time ConnectTimedOut, no answer in time NoAnswer; other
        network trouble Unavailable; a response this reader does not handle NotRaw."""
        lines = self._head_lines + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (f"POST {self._prefix}{path} HTTP/1.1\r\n{lines}content-type: application/json\r\n"
                   f"accept: {accept}\r\ncontent-length: {len(body)}\r\n\r\n").encode("latin-1") + body
        for attempt in range(2):
            conn, reused = self._take(timeout if connect_s is None else connect_s, fresh=attempt > 0)
            if cancel is not None:
                cancel.watch(conn.sock)
            try:
                conn.sock.settimeout(timeout)
                conn.sock.sendall(request)
                status, headers = _parse_head(conn.read_head())
                return self._answer(conn, status, headers, read)
            except ConnectionError as exc:
                # A kept-alive socket the server closed meanwhile fails before any answer: once more anew.
                if reused and not conn.received_any and attempt == 0 and not (cancel and cancel.fired):
                    continue
                raise Unavailable(f"HTTP fetch from {self._address[0]}:{self._address[1]} failed: {exc!r}") from exc
            except TimeoutError as exc:  # socket.timeout
                raise NoAnswer(f"HTTP fetch from {self._address[0]}:{self._address[1]}: no answer within "
                               f"{timeout} s") from exc
            except OSError as exc:
                raise Unavailable(f"HTTP fetch from {self._address[0]}:{self._address[1]} failed: {exc!r}") from exc
            finally:
                if cancel is not None:
                    cancel.watch(None)
                self._give(conn)
        raise AssertionError("unreachable")

    @staticmethod
    def _answer(conn: _Connection, status: int, headers: dict[str, str], read):
        if "transfer-encoding" in headers or "content-length" not in headers:
            raise NotRaw(f"response without a Content-Length body (status {status})")
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise NotRaw(f"Content-Length {headers['content-length']!r}") from None
        keep = headers.get("connection", "").lower() != "close"
        if status != 200:
            if length > MAX_ERROR_BODY_BYTES:
                raise NotRaw(f"status {status} with a {length}-byte body")
            body = conn.read_exact(length)
            conn.reusable = keep and conn.drained()
            raise http_error(status, headers, body)
        result = read(Response(conn, status, headers, length))
        conn.reusable = keep and conn.drained()
        return result

    def _take(self, timeout: float | None, fresh: bool) -> tuple[_Connection, bool]:
        with self._lock:
            if self._idle and not fresh:
                return self._idle.pop(), True
        connect_s = self._connect_timeout_s if timeout is None else min(timeout, self._connect_timeout_s)
        try:
            sock = socket.create_connection(self._address, timeout=connect_s)
        except TimeoutError as exc:
            raise ConnectTimedOut(f"cannot reach {self._origin}: the connect timed out after {connect_s:g} s") from exc
        except OSError as exc:
            raise Unreachable(f"cannot reach {self._origin}: {exc.strerror or exc!r}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(sock), False

    def _give(self, conn: _Connection) -> None:
        """Back to the idle list after a complete answer; closed after anything else (an error mid-body, a
        cancelled read: the rest of that answer would still arrive on it)."""
        if conn.reusable:
            with self._lock:
                if not self._closed and len(self._idle) < MAX_IDLE:
                    conn.reset()
                    self._idle.append(conn)
                    return
        conn.sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close()


def read_fetch(writer_for: Callable[[wire.WireHeader], wire.RowWriter]):
    """A `RawHttp.post` reader for an octet-stream fetch payload: the wire header, then the rows through
    `writer_for(header)`'s readinto straight into place. Returns (header, writer): the caller finishes it."""

    def read(response: Response):
        ctype = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != OCTET:
            raise NotRaw(f"a fetch answered {ctype!r}, not {OCTET}")
        header = wire.read_http_header(response.read_exact, response.length)
        writer = writer_for(header)
        writer.readinto(response.recv_into)
        return header, writer

    return read


def read_json(response: Response) -> dict:
    """A `RawHttp.post` reader for a small JSON answer (an shm fetch's header: the rows are in the file)."""
    ctype = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != JSON or response.length > MAX_ERROR_BODY_BYTES:
        raise NotRaw(f"a {response.length}-byte {ctype!r} answer where a JSON header was expected")
    try:
        return json.loads(response.read_exact(response.length))
    except ValueError as exc:
        raise wire.WireError(f"not an shm fetch answer: {exc!r}") from None


async def in_thread(threads, fn: Callable[[Cancel], T], dest=None) -> T:
    """`fn(cancel)`, a blocking fetch, on one of `threads`. When the awaiting task is cancelled the fetch's
    socket is shut down (its read ends at once instead of filling the buffer after we returned) and its
    staging buffer (`dest`, client/destination.py; None: the fetch has none) is abandoned, not reused."""
    cancel = Cancel()
    try:
        return await asyncio.get_running_loop().run_in_executor(threads, fn, cancel)
    except asyncio.CancelledError:
        cancel.fire()
        if dest is not None:
            dest.abandon()
        raise
