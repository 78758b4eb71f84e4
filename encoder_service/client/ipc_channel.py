"""The consumer's side of the same-host channel of the fetch by IPC (protocol/ipc_channel.py): one Unix socket
connection per server, kept, carrying the fetches by IPC (and, blocking clients, their acknowledgements)
instead of HTTP requests. Several fetches may be in flight on it at once (each frame names its request; a
reader, a thread or a task, hands each answer to its caller).

A transport (client/http.py) holds one link per server (`ChannelLink`, `AsyncChannelLink`). At its first fetch
by IPC the link reads the server's /v1/metadata: a channel ("ipc": "channel") on this host (the same boot id)
is connected (HELLO with the bearer token), else the link stays off. Any failure of the channel (its socket
gone, a connection closed mid-fetch, a frame that is not one) sends that fetch over HTTP, with one log line per
reason; the next fetch connects again (the metadata read again: a restarted server), at most once per
RETRY_S after a failed connect. A fetch the channel can't carry (an id over 64 KiB, a position outside int64)
goes over HTTP too, whose server answers what is wrong. A refused HELLO (the token) turns the channel off for
the link. The server's errors (an unknown id, a timeout) are raised as HTTP's are; no answer within the
request's timeout and MARGIN_S (the server's own bound on its waits) is NoAnswer, as a silent HTTP server's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from encoder_service import errors
from encoder_service.protocol import ipc_channel as proto
from encoder_service.protocol.errors import KINDS, remote_error
from encoder_service.protocol.ipc import IpcPlacement, IpcUnavailable, this_host
from encoder_service.protocol.wire import WireHeader
from encoder_service.rowpath.raw_http import NoAnswer

log = logging.getLogger("encoder_service.client")

CONNECT_TIMEOUT_S = 2.0  # connect and HELLO
METADATA_TIMEOUT_S = 5.0  # the read of the server's /v1/metadata (where its channel is), within the fetch's
RETRY_S = 1.0  # after a failed connect, HTTP alone this long
MARGIN_S = 1.0  # past the request's own timeout (the server answers 504 by then) before giving up on an answer


class ChannelDown(Exception):
    """The channel cannot carry this fetch (HTTP then)."""


class ChannelRefused(ChannelDown):
    """The server refused the connection's HELLO (the token)."""


def _answer(kind: int, body: bytes, items) -> tuple[WireHeader | None, IpcPlacement | IpcUnavailable]:
    """A fetch's answer frame as fetch_ipc answers (the header None when nothing was placed)."""
    try:
        if kind == proto.PLACED:
            return proto.read_placed(body, items)
        if kind == proto.UNPLACED:
            return None, proto.read_unplaced(body)
        if kind == proto.ERROR:
            error_kind, message = proto.read_error(body)
            known = KINDS.get(error_kind)
            raise remote_error(error_kind, message, known.http_status if known else 500)
    except proto.ChannelError as exc:
        raise ChannelDown(f"a malformed answer: {exc}") from None
    raise ChannelDown(f"frame type {kind} answering a fetch")


def _timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + MARGIN_S


def _fetch_frame(items, start: int, end: int, ipc: dict, timeout: float | None) -> Callable[[int], bytes]:
    """The FETCH frame of a fetch by IPC, given its request id (ChannelError: one the channel can't carry)."""
    hold, ack = ipc.get("hold", True), ipc.get("ack", ())
    return lambda request_id: proto.fetch_request(request_id, items, start, end, timeout, hold, ack)


def _metadata_timeout(timeout: float | None) -> float:
    return METADATA_TIMEOUT_S if timeout is None else min(timeout, METADATA_TIMEOUT_S)


def _no_answer(timeout: float | None) -> NoAnswer:
    return NoAnswer(f"no answer on the IPC channel within {timeout:.1f}s")


def _say_uncarried(exc: proto.ChannelError) -> None:
    log.debug("IPC channel: %s; this fetch goes over HTTP", exc)


class _LinkState:
    """What both links share: the socket's path (None: not known yet), why the link is off, when to connect
    again, the reasons logged."""

    def __init__(self, token: str | None):
        self.token, self.path, self.off = token, None, None
        self.retry_at = 0.0
        self._said: set[str] = set()

    def path_from(self, meta: dict) -> str | None:
        """The channel's path from the server's metadata; None (and off, said once) when it has none here."""
        ipc = meta.get("ipc") or {}
        if not ipc.get("channel") or ipc.get("host") != this_host() or not this_host():
            self.off = "the server advertises no IPC channel on this host"
            return None
        return ipc["channel"]

    def failed(self, exc: BaseException) -> None:
        """A connect or a fetch on the channel failed: HTTP for this fetch, one log line per reason."""
        if isinstance(exc, ChannelRefused):
            self.off = str(exc)
            log.warning("IPC channel refused (%s): fetching by IPC over HTTP from now on", exc)
            return
        why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ChannelDown) else str(exc)
        key = why.split(":")[0]
        log.log(logging.DEBUG if key in self._said else logging.INFO, "IPC channel: %s; this fetch goes over HTTP",
                why)
        self._said.add(key)
        self.path = None  # read the metadata again (a restarted server)
        self.retry_at = time.monotonic() + RETRY_S

    def may_connect(self) -> bool:
        return self.off is None and time.monotonic() >= self.retry_at


# ---- blocking ---------------------------------------------------------------------------------------------------
class _Connection:
    """One connection, its reader thread and the answers it waits for (request id -> Future). Sends and the
    answers' table have locks of their own: a send blocked on a server that reads no more (MAX_IN_FLIGHT)
    does not stop answers coming in."""

    def __init__(self, path: str, token: str | None):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._file = None
        try:
            self._sock.settimeout(CONNECT_TIMEOUT_S)
            self._sock.connect(path)
            self._sock.sendall(proto.hello(token))
            self._file = self._sock.makefile("rb")
            kind, _, body = self._read()
            if kind == proto.ERROR:
                raise ChannelRefused(proto.read_error(body)[1])
            if kind != proto.HELLO:
                raise ChannelDown(f"frame type {kind} answering the HELLO")
            self._sock.settimeout(None)
        except BaseException:
            self._close_socket()
            raise
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()  # `_pending`, `alive`
        self._send_lock = threading.Lock()  # one frame on the socket at a time
        self.alive = True
        threading.Thread(target=self._reader, name="encoder-ipc-channel", daemon=True).start()

    def call(self, make: Callable[[int], bytes], timeout: float | None) -> tuple[int, bytes]:
        """(type, body) of the answer to the frame `make(request_id)` (built before anything is registered:
        its ChannelError leaves nothing behind)."""
        request_id = next(self._ids) & 0xFFFFFFFF
        data = make(request_id)
        answer: Future = Future()
        with self._lock:
            if not self.alive:
                raise ChannelDown("the channel closed")
            self._pending[request_id] = answer
        try:
            self.send(data)
            return answer.result(timeout)
        except TimeoutError:
            raise _no_answer(timeout) from None
        finally:
            with self._lock:
                self._pending.pop(request_id, None)

    def send(self, data: bytes) -> None:
        with self._send_lock:
            if not self.alive:
                raise ChannelDown("the channel closed")
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise ChannelDown(f"a send failed: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self.alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader's read returns; a blocked send fails
        except OSError:
            pass
        self._close_socket()

    def _close_socket(self) -> None:
        """The socket and its reading file (the descriptor lives until both are closed)."""
        if self._file is not None:
            self._file.close()
        self._sock.close()

    def _read(self) -> tuple[int, int, bytes]:
        prefix = self._file.read(proto.PREFIX.size)
        if len(prefix) < proto.PREFIX.size:
            raise ChannelDown("the server closed the channel")
        try:
            n, kind, request_id = proto.read_prefix(prefix)
        except proto.ChannelError as exc:
            raise ChannelDown(str(exc)) from None
        body = self._file.read(n)
        if len(body) < n:
            raise ChannelDown("the server closed the channel mid-frame")
        return kind, request_id, body

    def _reader(self) -> None:
        try:
            while True:
                kind, request_id, body = self._read()
                with self._lock:
                    answer = self._pending.pop(request_id, None)
                if answer is not None:
                    answer.set_result((kind, body))
        except Exception as exc:  # noqa: BLE001 - whatever ends the reader fails the fetches waiting on it
            down = exc if isinstance(exc, ChannelDown) else ChannelDown(f"the channel failed: {exc!r}")
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        for answer in pending.values():
            answer.set_exception(down)
        self._close_socket()


class ChannelLink:
    """A blocking transport's channel to one server; `metadata(timeout)` reads the server's /v1/metadata."""

    def __init__(self, token: str | None, metadata: Callable[[], dict]):
        self._state, self._metadata = _LinkState(token), metadata
        self._conn: _Connection | None = None
        self._lock = threading.Lock()

    def fetch(self, items, start: int, end: int, ipc: dict, timeout: float | None):
        """(header, answer) of a fetch by IPC over the channel, or None: send it over HTTP."""
        conn = self._connection(timeout)
        if conn is None:
            return None
        try:
            kind, body = conn.call(_fetch_frame(items, start, end, ipc, timeout), _timeout(timeout))
            return _answer(kind, body, items)
        except proto.ChannelError as exc:  # the frame was not made: the connection is fine
            _say_uncarried(exc)
            return None
        except ChannelDown as exc:
            conn.close()
            self._state.failed(exc)
            return None

    def ack(self, tokens: list[str]) -> bool:
        """Acknowledge over the channel when it is up (no answer); False: send them over HTTP."""
        conn = self._conn
        if conn is None or not conn.alive:
            return False
        try:
            conn.send(proto.ack_request(tokens))
            return True
        except (ChannelDown, proto.ChannelError):
            return False

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            self._state.off = "closed"
        if conn is not None:
            conn.close()

    def _connection(self, timeout: float | None) -> _Connection | None:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        with self._lock:
            if self._conn is not None and self._conn.alive:
                return self._conn
            if not self._state.may_connect():
                return None
            try:
                if self._state.path is None:
                    self._state.path = self._state.path_from(self._metadata(_metadata_timeout(timeout)))
                    if self._state.path is None:
                        return None
                self._conn = _Connection(self._state.path, self._state.token)
            except (ChannelDown, OSError, errors.EncoderServiceError) as exc:
                self._state.failed(exc)
                return None
            return self._conn


# ---- asyncio ----------------------------------------------------------------------------------------------------
class _AsyncConnection:
    """One connection on the event loop, its reader task and the answers it waits for."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.alive = True
        self._task = asyncio.create_task(self._read_answers(), name="encoder-ipc-channel")

    @classmethod
    async def open(cls, path: str, token: str | None) -> _AsyncConnection:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path, limit=proto.MAX_FRAME),
                                                CONNECT_TIMEOUT_S)
        try:
            writer.write(proto.hello(token))
            kind, _, body = await asyncio.wait_for(_read_frame(reader), CONNECT_TIMEOUT_S)
            if kind == proto.ERROR:
                raise ChannelRefused(proto.read_error(body)[1])
            if kind != proto.HELLO:
                raise ChannelDown(f"frame type {kind} answering the HELLO")
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer)

    async def call(self, make: Callable[[int], bytes], timeout: float | None) -> tuple[int, bytes]:
        """See _Connection.call."""
        if not self.alive:
            raise ChannelDown("the channel closed")
        request_id = next(self._ids) & 0xFFFFFFFF
        data = make(request_id)
        answer = self._pending[request_id] = asyncio.get_running_loop().create_future()
        try:
            self._writer.write(data)
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise _no_answer(timeout) from None
        finally:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        self.alive = False
        self._task.cancel()
        self._writer.close()

    async def _read_answers(self) -> None:
        try:
            while True:
                kind, request_id, body = await _read_frame(self._reader)
                answer = self._pending.get(request_id)
                if answer is not None and not answer.done():
                    answer.set_result((kind, body))
        except (ChannelDown, OSError, asyncio.IncompleteReadError) as exc:
            down = exc if isinstance(exc, ChannelDown) else ChannelDown(f"the server closed the channel ({exc!r})")
        except asyncio.CancelledError:
            down = ChannelDown("the channel closed")
        self.alive = False
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(down)
        self._writer.close()


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    try:
        return await proto.read_frame(reader)
    except proto.ChannelError as exc:
        raise ChannelDown(str(exc)) from None


class AsyncChannelLink:
    """An asyncio transport's channel to one server (its acknowledgements stay on HTTP: they are sent by a
    thread); `metadata(timeout)` is a coroutine reading the server's /v1/metadata."""

    def __init__(self, token: str | None, metadata: Callable):
        self._state, self._metadata = _LinkState(token), metadata
        self._conn: _AsyncConnection | None = None
        self._connecting: asyncio.Lock | None = None

    async def fetch(self, items, start: int, end: int, ipc: dict, timeout: float | None):
        """See ChannelLink.fetch."""
        conn = self._conn if self._conn is not None and self._conn.alive else await self._connection(timeout)
        if conn is None:
            return None
        try:
            kind, body = await conn.call(_fetch_frame(items, start, end, ipc, timeout), _timeout(timeout))
            return _answer(kind, body, items)
        except proto.ChannelError as exc:  # the frame was not made: the connection is fine
            _say_uncarried(exc)
            return None
        except ChannelDown as exc:
            conn.close()
            self._state.failed(exc)
            return None

    def close(self) -> None:
        self._state.off = "closed"
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _connection(self, timeout: float | None) -> _AsyncConnection | None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connect at a time: the others use it
            if self._conn is not None and self._conn.alive:
                return self._conn
            if not self._state.may_connect():
                return None
            try:
                if self._state.path is None:
                    self._state.path = self._state.path_from(await self._metadata(_metadata_timeout(timeout)))
                    if self._state.path is None:
                        return None
                self._conn = await _AsyncConnection.open(self._state.path, self._state.token)
            except (ChannelDown, OSError, TimeoutError, errors.EncoderServiceError) as exc:
                self._state.failed(exc)
                return None
            return self._conn
