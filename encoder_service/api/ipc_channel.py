"""The same-host channel of the fetch by IPC, server side (protocol/ipc_channel.py has the frames): a Unix
domain socket beside HTTP, on the service's event loop, a thin adapter over the same core calls as HTTP's
fetch by IPC (`core.fetch(..., ipc=...)`, `core.ipc.ack`).

Where (`--ipc-channel`, ENCODER_IPC_CHANNEL): `auto` (the default) listens only where it is safe and useful:
with a device row arena, at `<tmp>/encoder-service-<uid>/ipc-<http host>-<http port>.sock` in a directory of
this uid's alone (made 0700; one that is not this uid's, or that others may enter, turns the channel off,
logged); a path listens there (its directory must exist); `off`. A socket already at the path is taken over
only when nobody listens on it (a connect refused: an earlier process's); a live one, or anything else there,
turns the channel off (logged), and stop() removes the socket only while it is the one this channel made.
The socket is made 0600, and each connection's peer (SO_PEERCRED) must be this uid (or root, whom 0600 does
not stop), so a connection made before the chmod by another uid is closed. With --auth-token each connection
first sends it (HELLO, checked once per connection), as every HTTP request does. Bounded: connections
(MAX_CONNECTIONS: one per consumer process and server), fetches in flight per connection (MAX_IN_FLIGHT: past
it the connection is not read until one ends), frames (protocol: MAX_FRAME; a HELLO, read before the token is
checked: MAX_HELLO), and the HELLO's wait (HELLO_TIMEOUT_S).

Each fetch is served as an HTTP one is (api/requests.py: its request id, metrics with transport "channel",
access line); its error is answered as an ERROR frame of its kind. A frame that is not one closes the
connection (the consumer goes back to HTTP). stop(grace_s) takes no new connection nor frame, lets the
fetches in flight end within grace_s, then closes every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import os
import re
import socket
import stat
import struct
import tempfile

from encoder_service.api.requests import served
from encoder_service.core import EncoderCore, FetchItem
from encoder_service.errors import EncoderServiceError, InvalidInput
from encoder_service.protocol import ipc_channel as proto
from encoder_service.protocol.errors import kind_of
from encoder_service.protocol.ipc import IpcError, IpcPlacement, IpcRequest
from encoder_service.protocol.wire import WireHeader

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
MAX_IN_FLIGHT = 64
HELLO_TIMEOUT_S = 5.0
STOP_GRACE_S = 10.0  # stop(): how long fetches in flight may take to end
CLOSED_WAIT_S = 5.0  # stop(): how long the connections' handlers may take to end once their sockets close
MAX_PATH = 107  # bytes of a Unix socket's path (sun_path)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def channel_path(setting: str, http_host: str, http_port: int, arena: bool) -> str | None:
    """Where the channel listens (`setting`: "auto", "off" or a path), or None (off: logged why when "auto"
    finds no safe place). Auto's name has the HTTP address: two services of one uid on different addresses
    and the same port get two sockets."""
    if setting == "off" or (setting == "auto" and not arena):
        return None
    if setting != "auto":
        return setting
    directory = os.path.join(tempfile.gettempdir(), f"encoder-service-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("the IPC channel is off: %s is not a directory of this uid's alone (mode 0700); set "
                    "--ipc-channel to a path in one", directory)
        return None
    host = re.sub(r"[^0-9A-Za-z.-]", "_", http_host)
    return os.path.join(directory, f"ipc-{host}-{http_port}.sock")


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the socket at `path` (only a refused connect says no: a socket
    we may not even connect to is not ours to remove)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as exc:
            return exc.errno != errno.ECONNREFUSED
    return True


def _peer_allowed(writer: asyncio.StreamWriter) -> bool:
    """The connection's peer is this uid or root (SO_PEERCRED; where the kernel has none, the socket's 0600)."""
    sock = writer.get_extra_info("socket")
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return True
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid in (os.getuid(), 0)


class IpcChannel:
    """`await start()` listens at `path` (False: could not, logged), `await stop(grace_s)`."""

    def __init__(self, core: EncoderCore, path: str, token: str | None, *, access_log: bool = False,
                 max_connections: int = MAX_CONNECTIONS, max_in_flight: int = MAX_IN_FLIGHT):
        self.core, self.path = core, path
        self._token = (token or "").encode()
        self._access_log, self._max_connections, self._max_in_flight = access_log, max_connections, max_in_flight
        self._server: asyncio.base_events.Server | None = None
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket this channel made
        self._connections: dict[asyncio.Task, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._fetches: set[asyncio.Task] = set()  # in flight, every connection's
        self._stopping = False

    async def start(self) -> bool:
        if len(self.path.encode()) > MAX_PATH:
            log.warning("the IPC channel is off: its path %r is longer than a Unix socket's (%d bytes)", self.path,
                        MAX_PATH)
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._bind(sock)
            st = os.lstat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            os.chmod(self.path, 0o600)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=proto.MAX_FRAME)
        except OSError as exc:
            sock.close()
            log.warning("the IPC channel is off: cannot listen on %s (%s)", self.path, exc)
            self._remove_ours()
            return False
        return True

    def _bind(self, sock: socket.socket) -> None:
        """Bind at the path (bind never replaces a file); a socket there nobody listens on (an earlier
        process's) is removed first. OSError: the path is taken (said why)."""
        try:
            sock.bind(self.path)
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        st = os.lstat(self.path)
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, "it exists and is not a socket")
        if _listening(self.path):
            raise OSError(errno.EADDRINUSE, "another process listens on it (another service on this port?)")
        os.unlink(self.path)
        sock.bind(self.path)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """No new connection nor frame; the fetches in flight end (up to `grace_s`, then cancelled); every
        connection closed; the socket removed while it is still this channel's."""
        if self._server is None:
            return
        self._server.close()  # (listening no more before `_stopping` says so)
        self._stopping = True
        for reader, writer in self._connections.values():  # each handler reads what it has, then stops
            writer.transport.pause_reading()
            reader.feed_eof()
        if self._fetches:
            _, late = await asyncio.wait(set(self._fetches), timeout=grace_s)
            for task in late:
                task.cancel()
        for _, writer in self._connections.values():  # (cancelling a handler would log an error)
            writer.close()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=CLOSED_WAIT_S)
        self._remove_ours()
        self._server = None

    def _remove_ours(self) -> None:
        """Unlink the path while it is the socket this channel made (not a later process's)."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections[task] = reader, writer
        fetches: set[asyncio.Task] = set()
        try:
            if len(self._connections) > self._max_connections:
                log.warning("IPC channel: %d connections, over the limit: one refused", len(self._connections))
                return
            if not _peer_allowed(writer):
                log.warning("IPC channel: a connection from another uid refused")
                return
            if await self._hello(reader, writer):
                await self._requests(reader, writer, fetches)
        except (proto.ChannelError, asyncio.IncompleteReadError, ConnectionError) as exc:
            log.debug("IPC channel: a connection ended: %s", exc)
        finally:
            if fetches and self._stopping:  # their answers go out first (stop() cancels them past its grace)
                await asyncio.wait(fetches)
            for fetch in fetches:
                fetch.cancel()
            self._connections.pop(task, None)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            kind, _, body = await asyncio.wait_for(proto.read_frame(reader, proto.MAX_HELLO), HELLO_TIMEOUT_S)
        except TimeoutError:
            return False
        if kind != proto.HELLO:
            raise proto.ChannelError(f"frame type {kind} before the HELLO")
        given = proto.read_hello(body).encode()
        if self._token and not hmac.compare_digest(given, self._token):
            writer.write(proto.error(0, "unauthenticated", "wrong or missing bearer token"))
            await writer.drain()
            return False
        writer.write(proto.frame(proto.HELLO, 0))
        return True

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        fetches: set[asyncio.Task]) -> None:
        in_flight = asyncio.Semaphore(self._max_in_flight)
        while True:
            kind, request_id, body = await proto.read_frame(reader)
            if self._stopping:  # read before stop(): not served
                return
            if kind == proto.FETCH:
                await in_flight.acquire()
                if self._stopping:
                    return
                task = asyncio.create_task(self._fetch(request_id, body, writer, in_flight))
                for live in (fetches, self._fetches):
                    live.add(task)
                    task.add_done_callback(live.discard)
            elif kind == proto.ACK:
                self.core.ipc.ack(proto.read_ack(body))
            else:
                raise proto.ChannelError(f"frame type {kind} from a consumer")

    async def _fetch(self, request_id: int, body: bytes, writer: asyncio.StreamWriter,
                     in_flight: asyncio.Semaphore) -> None:
        try:
            with served(self.core.metrics, "channel", "fetch", None, access_log=self._access_log) as serving:
                try:
                    answer = await self._answer(request_id, body)
                except EncoderServiceError as exc:
                    serving.observed.failed(exc)
                    answer = proto.error(request_id, kind_of(exc), exc.message)
                except Exception as exc:  # a bug: the traceback in the log, not in the answer
                    serving.observed.failed(exc)
                    log.exception("IPC channel fetch failed")
                    answer = proto.error(request_id, "internal", "internal error")
            writer.write(answer)
            await writer.drain()  # a consumer that does not read stops this connection's reads
        except ConnectionError:
            pass
        finally:
            in_flight.release()

    async def _answer(self, request_id: int, body: bytes) -> bytes:
        try:
            items, start, end, timeout_s, hold, ack = proto.read_fetch(body)
            request = IpcRequest(self.core.ipc.host, hold, ack)
        except (proto.ChannelError, IpcError) as exc:
            raise InvalidInput(f"IPC channel fetch: {exc}") from None
        result = await self.core.fetch([FetchItem(i, o) for i, o in items], start, end, timeout_s=timeout_s,
                                       ipc=request)
        if not isinstance(result.ipc, IpcPlacement):
            return proto.unplaced(request_id, result.ipc)
        try:
            return proto.placed(request_id, items, WireHeader.of_fetch(result), result.ipc)
        except proto.ChannelError as exc:  # rows of an id the fetch named otherwise: the hold is not given
            if result.ipc.token is not None:
                self.core.ipc.ack([result.ipc.token])
            raise InvalidInput(f"IPC channel fetch: {exc}") from None
