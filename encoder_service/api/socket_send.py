"""Fetched rows written by pool threads straight onto the connection's socket, so several fetches' bytes leave
the process at once.

One asyncio loop writes every HTTP response, and sending costs the server about 0.3 CPU seconds per GB (most
of it the kernel's copy into the socket): one loop tops out near 3 GB/s however many clients read, and while
it sends it runs nothing else (the encodes' bookkeeping included). A blocking `sendall` releases the GIL, so N
threads make N kernel copies at once.

`SocketSend(app, threads)` wraps the ASGI app uvicorn runs. For each HTTP request served by uvicorn's httptools
protocol it puts a `SocketWriter` in `scope["extensions"]`; `RowsResponse` (api/rows_response.py) sends the status
line, headers and wire header through ASGI as always, then hands the rows (a memoryview of the cache entry, no
copy) to `SocketWriter.write`:
  1. wait until the transport holds no unsent bytes (the headers went to the kernel);
  2. a pool thread writes the rows with `sendall` on a dup of the connection's file descriptor (non-blocking,
     so with a timeout: SEND_TIMEOUT_S in all); HTTP/1.1 sends one response at a time on a connection, so the
     loop writes nothing there meanwhile;
  3. the protocol's count of body bytes still due drops by what the thread sent, and the response ends with an
     empty body message through ASGI.
A send error or timeout closes the connection (the client sees a short body, as with any dropped connection).
A JSON answer, whose body comes at once, is written whole instead (`SocketWriter.whole_answer`, api/http.py):
its status line and headers wait for the body and leave with it in one write (up to WHOLE_MAX_BYTES of body).

uvicorn's ASGI interface has no "write these bytes from a thread", so this goes through its httptools
protocol's per-request cycle (api/uvicorn_internals.py: RequestCycle; checked once, at start-up). Anything
else - the h11 protocol, another server, an in-process test client - gets no writer, and RowsResponse sends
through ASGI.

When every thread is busy a fetch waits for one, up to QUEUE_WAIT_S: readers that keep up free a thread in
tens of milliseconds, and a fetch sent by the loop meanwhile would cap every connection at the loop's rate
(16 concurrent fetches against 8 threads sent about half their rows through the loop). Past the wait the fetch takes
the loop path: readers that stall hold their threads until they read or time out, the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from starlette.types import ASGIApp, Receive, Scope, Send

from encoder_service.api.uvicorn_internals import RequestCycle, httptools_cycle_type, request_cycle

log = logging.getLogger("encoder_service")

EXTENSION = "encoder_service.socket_writer"
SENT, GONE, NOT_TAKEN = "sent", "gone", "not taken"  # SocketWriter.write's outcomes
MIN_BYTES = 1 << 20  # smaller rows go through ASGI: a thread hand-off costs ~0.1 ms
SEND_TIMEOUT_S = 60.0  # a whole row write; 67 MB at 10 Mbit/s would take 54 s
DRAIN_POLL_S, DRAIN_WAIT_S = 0.001, 1.0  # waiting for the headers to leave; else the loop path
QUEUE_WAIT_S = 0.25  # waiting for a free thread; else the loop path
WHOLE_MAX_BYTES = 1 << 16  # a JSON body up to this size leaves with its headers in one write (whole_answer)


class SocketSend:
    """ASGI middleware: hands each HTTP request on uvicorn's httptools protocol a SocketWriter (module docstring)."""

    def __init__(self, app: ASGIApp, threads: int):
        self.app = app
        self._cycle_type = httptools_cycle_type() if threads > 0 else None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="row-send") if self._cycle_type else None
        self._free = FreeThreads(threads) if self._cycle_type else None
        if threads > 0 and self._cycle_type is None:
            log.info("fetched rows are written on the event loop: uvicorn serves HTTP without httptools")

    @property
    def active(self) -> bool:
        return self._pool is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._pool is not None and scope["type"] == "http" and (cycle := request_cycle(send, self._cycle_type)):
            scope.setdefault("extensions", {})[EXTENSION] = SocketWriter(cycle, self._pool, self._free)
        await self.app(scope, receive, send)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class FreeThreads:
    """The send threads not writing, counted on the event loop: `take` waits in line for one, up to a bound.

    Not asyncio.wait_for over a Semaphore: a timeout that fires as the permit arrives would lose the permit
    (one thread fewer for good). Here a permit goes to a waiter's future, and a waiter cancelled after its
    permit came gives it back."""

    def __init__(self, n: int):
        self._free = n
        self._line: deque[asyncio.Future] = deque()

    async def take(self, wait_s: float) -> bool:
        if self._free and not self._line:
            self._free -= 1
            return True
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._line.append(waiter)
        timer = loop.call_later(wait_s, self._give_up, waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.give()
            raise
        finally:
            timer.cancel()
            if waiter in self._line:
                self._line.remove(waiter)

    def _give_up(self, waiter: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_result(False)

    def give(self) -> None:
        while self._line:
            waiter = self._line.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._free += 1


class SocketWriter:
    """Writes one response's rows from a pool thread; see the module docstring for the steps. Also writes a
    small answer whole (`whole_answer`)."""

    def __init__(self, cycle: RequestCycle, pool: ThreadPoolExecutor, free: FreeThreads):
        self._cycle, self._pool, self._free = cycle, pool, free

    @contextlib.contextmanager
    def whole_answer(self) -> Iterator[None]:
        """While inside, the response's status line and headers wait for its first body bytes and go out with
        them in one transport write: one send at the server and one read at the client instead of two each
        (uvicorn writes the headers as soon as they come). Only for an answer whose body comes at once (a JSON
        answer): rows written by a thread must find the headers sent (step 1 above)."""
        held = _HeadWithBody(self._cycle.transport)
        try:
            with self._cycle.transport_replaced(held):
                yield
        finally:
            held.flush()

    async def write(self, rows: memoryview) -> str:
        """SENT: the rows went out, end the response; GONE: the connection closed, send nothing more;
        NOT_TAKEN: nothing was written (small rows, headers not drained, no thread free in time): send via ASGI."""
        transport = self._cycle.transport
        if len(rows) < MIN_BYTES or not await _drained(transport) or not await self._free.take(QUEUE_WAIT_S):
            return NOT_TAKEN
        try:
            if transport.is_closing():  # the peer left (its connection_lost may not have run yet)
                return await _gone(transport)
            fd = transport.get_extra_info("socket").fileno()
            await asyncio.get_running_loop().run_in_executor(self._pool, _sendall, fd, rows)
        except OSError as e:  # the peer left, or it stopped reading for SEND_TIMEOUT_S
            log.info("fetch rows not delivered, closing the connection: %s", e)
            return await _gone(transport)
        finally:
            self._free.give()
        self._cycle.sent_elsewhere(len(rows))
        return SENT


class _HeadWithBody:
    """A transport whose first write (a response's status line and headers) is held until the next one."""

    def __init__(self, transport):
        self._transport, self._head = transport, None
        self._writes = 0

    def write(self, data) -> None:
        self._writes += 1
        if self._writes == 1:
            self._head = bytes(data)
            return
        if self._head is not None:
            head, self._head = self._head, None
            if len(data) > WHOLE_MAX_BYTES:  # a large body (embeddings in JSON): not copied to join them
                self._transport.write(head)
            else:
                data = head + bytes(data)
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def __getattr__(self, name: str):  # is_closing, close, get_extra_info, ...: the transport's own
        return getattr(self._transport, name)


async def _gone(transport) -> str:
    """GONE, once uvicorn knows the connection is over: aborted (unsent bytes dropped: nobody reads them), so
    its connection_lost is scheduled at once and runs before this returns. A response that ends unfinished on
    a connection uvicorn still thinks open is an ERROR in its log."""
    transport.abort()  # (on a transport closing already: its connection_lost is scheduled already)
    await asyncio.sleep(0)
    return GONE


async def _drained(transport) -> bool:
    """Waits (up to DRAIN_WAIT_S) until the transport holds no unsent bytes."""
    for _ in range(int(DRAIN_WAIT_S / DRAIN_POLL_S)):
        if transport.is_closing() or not transport.get_write_buffer_size():
            return True
        await asyncio.sleep(DRAIN_POLL_S)
    return False


def _sendall(fd: int, rows: memoryview) -> None:
    with socket.socket(fileno=os.dup(fd)) as sock:  # a dup: closing ours leaves the transport's socket open
        sock.settimeout(SEND_TIMEOUT_S)  # the file is non-blocking already (asyncio's); this adds the bound
        sock.sendall(rows)
