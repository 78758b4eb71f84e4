"""The same-host channel of the fetch by IPC, server side (protocol/ipc_channel.py has the frames): a Unix
domain socket beside HTTP, on the service's event loop, a thin adapter over the same core calls as HTTP's
fetch by IPC (`core.fetch(..., ipc=...)`, `core.ipc.ack`).

Where (`--ipc-channel`, ENCODER_IPC_CHANNEL): `auto` (the default) listens only where it is safe and useful:
with a device row arena, at `<tmp>/encoder-service-<uid>/ipc-<http port>.sock` in a directory of this uid's
alone (made 0700; one that is not this uid's, or that others may enter, turns the channel off, logged); a path
listens there (its directory must exist); `off`. The socket is made 0600 (only this uid connects), a
stale one from an earlier process on the path replaced. With --auth-token each connection first sends it
(HELLO, checked once per connection), as every HTTP request does. Bounded: connections (MAX_CONNECTIONS: one
per consumer process and server), fetches in flight per connection (MAX_IN_FLIGHT: past it the connection is
not read until one ends), frames (protocol: MAX_FRAME), and the HELLO's wait (HELLO_TIMEOUT_S).

Each fetch is served as an HTTP one is (api/requests.py: its request id, metrics with transport "channel",
access line); its error is answered as an ERROR frame of its kind. A frame that is not one closes the
connection (the consumer goes back to HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import stat
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
MAX_PATH = 107  # bytes of a Unix socket's path (sun_path)


def channel_path(setting: str, http_port: int, arena: bool) -> str | None:
    """Where the channel listens (`setting`: "auto", "off" or a path), or None (off: logged why when "auto"
    finds no safe place)."""
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
    return os.path.join(directory, f"ipc-{http_port}.sock")


class IpcChannel:
    """`await start()` listens at `path` (False: could not, logged), `await stop()`."""

    def __init__(self, core: EncoderCore, path: str, token: str | None, *, access_log: bool = False,
                 max_connections: int = MAX_CONNECTIONS, max_in_flight: int = MAX_IN_FLIGHT):
        self.core, self.path = core, path
        self._token = (token or "").encode()
        self._access_log, self._max_connections, self._max_in_flight = access_log, max_connections, max_in_flight
        self._server: asyncio.base_events.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def start(self) -> bool:
        if len(self.path.encode()) > MAX_PATH:
            log.warning("the IPC channel is off: its path %r is longer than a Unix socket's (%d bytes)", self.path,
                        MAX_PATH)
            return False
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                log.warning("the IPC channel is off: %s exists and is not a socket", self.path)
                return False
            os.unlink(self.path)  # an earlier process's (the HTTP port it is named for was free: ours now)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=proto.MAX_FRAME)
            os.chmod(self.path, 0o600)
        except OSError as exc:
            log.warning("the IPC channel is off: cannot listen on %s (%s)", self.path, exc)
            return False
        return True

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in self._connections.values():  # each handler's read ends (cancelling it would log an error)
            writer.close()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=HELLO_TIMEOUT_S)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections[task] = writer
        try:
            if len(self._connections) > self._max_connections:
                log.warning("IPC channel: %d connections, over the limit: one refused", len(self._connections))
                return
            if await self._hello(reader, writer):
                await self._requests(reader, writer)
        except (proto.ChannelError, asyncio.IncompleteReadError, ConnectionError) as exc:
            log.debug("IPC channel: a connection ended: %s", exc)
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            kind, _, body = await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT_S)
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

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        in_flight = asyncio.Semaphore(self._max_in_flight)
        fetches: set[asyncio.Task] = set()
        try:
            while True:
                kind, request_id, body = await _read_frame(reader)
                if kind == proto.FETCH:
                    await in_flight.acquire()
                    task = asyncio.create_task(self._fetch(request_id, body, writer, in_flight))
                    fetches.add(task)
                    task.add_done_callback(fetches.discard)
                elif kind == proto.ACK:
                    self.core.ipc.ack(proto.read_ack(body))
                else:
                    raise proto.ChannelError(f"frame type {kind} from a consumer")
        finally:
            for task in fetches:
                task.cancel()

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
        if isinstance(result.ipc, IpcPlacement):
            return proto.placed(request_id, items, WireHeader.of_fetch(result), result.ipc)
        return proto.unplaced(request_id, result.ipc)


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    length, kind, request_id = proto.PREFIX.unpack(await reader.readexactly(proto.PREFIX.size))
    if not 5 <= length <= proto.MAX_FRAME:
        raise proto.ChannelError(f"a frame of {length} bytes (at most {proto.MAX_FRAME})")
    return kind, request_id, await reader.readexactly(length - 5)
