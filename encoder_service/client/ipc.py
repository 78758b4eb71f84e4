"""The consumer's side of the fetch by IPC (protocol/ipc.py): rows straight from the encoder's GPU memory into
`out` on this process's GPU, one device-to-device copy per segment, no host memory on the way.

A client (client/base.py) tries it first for a fetch into a CUDA `out` when the server's /v1/metadata says IPC
is on, on this host (the same boot id) and of a kind this process reads; then the way it fetches otherwise
(shared memory with shm=True, else the socket). For one fetch:

  1. POST /v1/fetch with "ipc" (and the hold tokens of earlier fetches whose copies are done, `Acks`: that
     server's), over the server's same-host channel when it has one (client/ipc_channel.py), to the ids'
     owner when one is known (client/owners.py);
  2. the answer places each segment's rows in the server's arena (else says why not: step 5; a replica
     without the ids names their owner, asked next: client/base.py);
  3. `CudaIpcReader` opens the arena's handle once per server process (its `generation`; several servers'
     at once, a server's older one closed when it restarts: `Generations`) and device
     (cudaIpcOpenMemHandle with lazy peer access, with out's device current), then each segment's bytes are
     copied into out's rows at position - start (cudaMemcpyAsync on out's device's current stream; through a
     temporary, then cast, when `out` is of another dtype), and that stream is synchronized (the same contract
     as the other paths: when fetch returns, `out` has the rows);
  4. the copy finished less than the answer's `lease_s` after the request was sent: the server kept those
     bytes still (it holds them at least that long from its receipt). Else they may have been rewritten:
     the fetch goes the next way. Either way its token is acknowledged (`Acks`: with the next fetch, or on a
     background thread a few ms later);
  5. any reason not to (the server's answer, a refused open, a lease passed) -> the next way, with one log
     line per reason. A refused open (a container without the right capabilities, MIG, a sandboxed kernel, the
     server's own process) turns IPC off for this client; the rest are per fetch.
Server errors (an unknown id, a timeout) are raised as on every path.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from encoder_service.protocol import wire
from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.ipc import MAX_ACK_TOKENS, IpcPlacement, IpcRequest, IpcUnavailable, this_host
from encoder_service.rowpath import cuda_ipc

log = logging.getLogger("encoder_service.client")

ACK_DELAY_S = 0.005  # a token waits this long for a fetch to carry it before the background thread sends it
ACK_TIMEOUT_S = 5.0  # one acknowledgement's request
MAX_SERVERS = 256  # servers whose arena generation is remembered (one per replica a client reached)
MAX_MAPPINGS = 16  # arenas kept open per reader (one per replica process on this host and device)
_QUOTED = re.compile(r"'[^']*'")  # an id in a server's reason
ACK_WAIT_S = 1.0  # the background thread's longest sleep (it ends at close)


class _Mappings:
    """Opened arenas, (generation, device index) -> the mapping (`open(handle, index)`; `close(key, mapping)`
    after the device's queued work). A mapping is in use for the length of each copy from it (`acquire` ..
    `release`) and closed only when none uses it: by `forget` (its server is gone), or as the least recently
    used one past `limit`. Thread-safe."""

    def __init__(self, open_: Callable[[bytes, int], int], close: Callable[[tuple[str, int], int], None],
                 limit: int):
        self._open, self._close, self._limit = open_, close, limit
        self._live: OrderedDict[tuple[str, int], list] = OrderedDict()  # key -> [mapping, copies using it]
        self._leaving: dict[int, list] = {}  # forgotten or pushed out while in use: id(entry) -> entry
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._live) + len(self._leaving)

    def acquire(self, key: tuple[str, int], handle: bytes) -> tuple[int, list]:
        """(the mapping, the entry to `release` when the copy is queued), opened the first time."""
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [self._open(handle, key[1]), 0, key]
            self._live.move_to_end(key)
            entry[1] += 1
            idle = self._push_out()
        self._close_all(idle)
        return entry[0], entry

    def release(self, entry: list) -> None:
        with self._lock:
            entry[1] -= 1
            done = entry[1] == 0 and self._leaving.pop(id(entry), None) is not None
        if done:
            self._close_all([entry])

    def forget(self, generation: str) -> None:
        """That server process's arena is gone: its mappings closed (once no copy uses them)."""
        with self._lock:
            idle = [self._leave(key) for key in [k for k in self._live if k[0] == generation]]
        self._close_all([e for e in idle if e is not None])

    def close(self) -> None:
        with self._lock:
            entries = list(self._live.values()) + list(self._leaving.values())
            self._live.clear()
            self._leaving.clear()
        self._close_all(entries)

    def _push_out(self) -> list:
        """(under the lock) The least recently used mappings past the limit: those idle, to close now."""
        idle = []
        for key in list(self._live)[:max(0, len(self._live) - self._limit)]:
            entry = self._leave(key)
            if entry is not None:
                idle.append(entry)
        return idle

    def _leave(self, key: tuple[str, int]) -> list | None:
        """(under the lock) `key` leaves the live mappings: its entry when idle (close it), else None (its last
        copy closes it)."""
        entry = self._live.pop(key)
        if entry[1] == 0:
            return entry
        self._leaving[id(entry)] = entry
        return None

    def _close_all(self, entries: list) -> None:
        for mapping, _, key in entries:
            self._close(key, mapping)


class CudaIpcReader:
    """Opens arenas' IPC handles on CUDA devices (one mapping per (generation, device): several servers' arenas
    at once, replicas on this host; at most MAX_MAPPINGS) and copies byte ranges out of them with
    cudaMemcpyAsync on the device's current stream; `forget(generation)` closes a server process's mappings
    (it restarted: Generations) once no copy uses them. Thread-safe."""

    kind = cuda_ipc.KIND

    def __init__(self):
        self._maps = _Mappings(_open_handle, _close_handle, MAX_MAPPINGS)

    def accepts(self, out: torch.Tensor) -> bool:
        return out.is_cuda

    def copy(self, handle: bytes, generation: str, pieces: list[tuple[int, int, torch.Tensor]]) -> None:
        """Queue each (arena offset, nbytes, contiguous destination on one device) copy on that device's current
        stream (opening the handle there the first time)."""
        device = pieces[0][2].device
        current = torch.cuda.current_device()
        index = device.index if device.index is not None else current
        base, entry = self._maps.acquire((generation, index), handle)
        try:
            stream = torch.cuda.current_stream(index).cuda_stream
            # (the runtime copies on the current device's context: switched only when `out` is on another one)
            with torch.cuda.device(index) if index != current else contextlib.nullcontext():
                for offset, nbytes, dst in pieces:
                    cuda_ipc.memcpy_async(dst.data_ptr(), base + offset, nbytes, stream)
        finally:  # a mapping closed after this waits for the device's queued copies first (_close_handle)
            self._maps.release(entry)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()

    def forget(self, generation: str) -> None:
        """Close the mappings of that server process's arena (it is gone), once no copy uses them."""
        self._maps.forget(generation)

    def close(self) -> None:
        self._maps.close()


def _open_handle(handle: bytes, index: int) -> int:
    with torch.cuda.device(index):
        return cuda_ipc.open_handle(handle)


def _close_handle(key: tuple[str, int], ptr: int) -> None:
    try:
        with torch.cuda.device(key[1]):
            torch.cuda.synchronize()  # copies queued from it end first
            cuda_ipc.close_handle(ptr)
    except (cuda_ipc.CudaIpcError, RuntimeError) as exc:
        log.debug("closing an IPC mapping failed: %s", exc)


class Generations:
    """Each server's arena generation last copied from (`server`: its address, as the client reaches it); a
    new one means the server restarted: its older arena is closed in the reader (`forget`, unless another
    server's is that one), whose mappings of other servers' arenas (replicas on this host) stay open. An
    address that shows a generation it showed before is several servers (a Service over replicas on this
    host, the channel off): no restart is told from it any more, its arenas are left to the reader's LRU.
    Thread-safe."""

    def __init__(self, reader):
        self._reader = reader
        # server -> [its generation (None: several servers answer there), the generations it showed before]
        self._by_server: OrderedDict[str, list] = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, server: str, generation: str) -> None:
        with self._lock:
            seen = self._by_server.get(server)
            if seen is None:
                seen = self._by_server[server] = [None, deque(maxlen=MAX_MAPPINGS)]
                if len(self._by_server) > MAX_SERVERS:
                    self._by_server.popitem(last=False)
            elif seen[0] is None and seen[1]:  # several servers at this address
                return
            self._by_server.move_to_end(server)
            old = seen[0]
            if old == generation:
                return
            if generation in seen[1]:  # an older one again: not a restart, another server behind the address
                seen[0] = None
                return
            seen[0] = generation
            if old is None:
                return
            seen[1].append(old)
            if any(s[0] == old for s in self._by_server.values()):
                return
        self._reader.forget(old)


class Acks:
    """Hold tokens whose copies are done, on their way back: taken by the next IPC fetch (`take`), else sent
    by a background thread (`post(tokens)`, blocking) once the oldest has waited ACK_DELAY_S. A failed send
    is dropped: the server's lease ends those holds anyway.

    The thread is woken only from its idle wait (nothing pending): while fetches follow each other it wakes
    at its own deadlines, so a fetch does not pay a thread switch (a large share of a small fetch's time)."""

    def __init__(self, post: Callable[[list[str]], None]):
        self._post = post
        self._pending: list[str] = []
        self._since = 0.0  # when the oldest pending token came
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits with nothing pending (add wakes it)
        self._closed = False

    def add(self, token: str) -> None:
        with self._cv:
            self._pending.append(token)
            self._wake()

    def _wake(self) -> None:
        """(under the lock, tokens just added) The thread sends them ACK_DELAY_S after the oldest came."""
        if len(self._pending) == 1 or self._idle:
            self._since = time.monotonic()
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="encoder-ipc-acks", daemon=True)
            self._thread.start()
        if self._idle:
            self._cv.notify()

    def take(self) -> list[str]:
        with self._cv:
            taken, self._pending = self._pending[:MAX_ACK_TOKENS], self._pending[MAX_ACK_TOKENS:]
            self._since = time.monotonic()
            return taken

    def restore(self, tokens) -> None:
        """Tokens `take`n into a request that failed: pending again, first in line."""
        if tokens:
            with self._cv:
                self._pending[:0] = tokens
                if not self._closed:
                    self._wake()

    def close(self, send: bool = True) -> None:
        """Send what is pending (once; `send` False: drop it, the server is gone), stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(ACK_WAIT_S + 1.0)
        if send:
            self._send(self.take())

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                self._idle = not self._pending
                wait = ACK_WAIT_S if self._idle else self._since + ACK_DELAY_S - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    self._idle = False
                    continue
            self._send(self.take())

    def _send(self, tokens: list[str]) -> None:
        if tokens:
            try:
                self._post(tokens)
            except Exception as exc:  # noqa: BLE001 - the holds end at their lease
                log.debug("acknowledging %d IPC holds failed: %s", len(tokens), exc)


class IpcPath:
    """One client's fetch by IPC: its reader (None until a CUDA `out` needs the default one), and why it is off
    (for good) if it is. The hold tokens go back to the server that held the rows (`acks`: that server's
    transport's `ipc_acks`)."""

    def __init__(self, reader=None):
        self.reader = reader
        self.off: str | None = None
        self._said: set[str] = set()
        self._generations: Generations | None = None  # made with the reader

    def candidate(self, out: torch.Tensor) -> bool:
        """Whether a fetch into `out` may go by IPC at all (before asking the server anything)."""
        if self.off is not None:
            return False
        return out.is_cuda if self.reader is None else self.reader.accepts(out)

    @staticmethod
    def same_host(meta: dict | None) -> bool:
        """The server's metadata["ipc"] says IPC is on, on this host."""
        return bool(meta) and meta.get("host") == this_host() != ""

    def may_hold(self, meta: dict | None) -> bool:
        """Whether rows may come by IPC from that server (its metadata["ipc"]) at all: on, on this host, of
        the kind this client reads (CUDA's until a reader is made), this client's IPC not off."""
        kind = self.reader.kind if self.reader is not None else cuda_ipc.KIND
        return self.off is None and self.same_host(meta) and meta.get("kind") == kind

    def wants(self, out: torch.Tensor, meta: dict | None) -> bool:
        """Whether to try IPC for a fetch into `out`, given the server's metadata["ipc"] (CUDA's reader made
        the first time)."""
        if not (self.candidate(out) and self.may_hold(meta)):
            return False
        if self.reader is None:
            self.reader = CudaIpcReader()
        return True

    def unplaced(self, answer: IpcUnavailable) -> None:
        """The server placed nothing: one log line per reason (the ids it names aside)."""
        self._say(_QUOTED.sub("''", answer.reason), "the server: " + answer.reason)

    def finish(self, header: wire.WireHeader, answer: IpcPlacement | IpcUnavailable, out: torch.Tensor,
               start: int, sent: float, acks: Acks, server: str) -> torch.Tensor | None:
        """Copy the placed rows into `out` (`sent`: time.monotonic() before the request went; `acks`, `server`:
        those of the server that answered, its address); `out`, or None (the rows are not there: fetch them
        the next way)."""
        if isinstance(answer, IpcUnavailable):
            self.unplaced(answer)
            return None
        try:
            copied = self._copy(header, answer, out, start)
        except wire.WireError:
            _ack(answer, acks)
            raise  # `out` can't hold the rows: the next way would say the same
        except (cuda_ipc.CudaIpcError, OSError, RuntimeError) as exc:
            _ack(answer, acks)
            self.off = f"{type(exc).__name__}: {exc}"
            log.warning("fetch by IPC is off for this client (%s); fetching over the next path from now on", exc)
            return None
        elapsed = time.monotonic() - sent
        _ack(answer, acks)
        if self._generations is None:
            self._generations = Generations(self.reader)
        self._generations.seen(server, answer.generation)
        if not copied:
            return None
        if elapsed >= answer.lease_s:  # the server may have reused those bytes while we read them
            self._say("lease", f"the copy ended {elapsed:.3f}s after the request, past the {answer.lease_s:g}s hold")
            return None
        return out

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def _copy(self, header: wire.WireHeader, answer: IpcPlacement, out: torch.Tensor, start: int) -> bool:
        """Each segment's bytes into its rows of `out` (through a temporary of the rows' dtype when `out` is of
        another dtype or not contiguous there), then the stream synchronized."""
        wire.check_out(header, out, start)
        if answer.kind != self.reader.kind:
            self._say("kind", f"the server's arena is {answer.kind}, this client reads {self.reader.kind}")
            return False
        dtype, row_bytes = torch_dtype(header.dtype), header.row_bytes
        pieces, casts = [], []
        for offset, s in zip(answer.offsets, header.segments):
            nbytes = s.num_rows * row_bytes
            if offset % dtype.itemsize or offset + nbytes > answer.size:
                raise wire.WireError(f"IPC offset {offset} (+{nbytes}) outside the {answer.size}-byte arena")
            at = s.position - start
            dst = out if at == 0 and s.num_rows == len(out) else out[at:at + s.num_rows]
            if dst.dtype != dtype or not dst.is_contiguous():
                casts.append((dst, torch.empty((s.num_rows, header.row_width), dtype=dtype, device=out.device)))
                dst = casts[-1][1]
            pieces.append((offset, nbytes, dst))
        if pieces:
            self.reader.copy(answer.handle, answer.generation, pieces)
        for dst, rows in casts:
            dst.copy_(rows)
        self.reader.synchronize(out.device)
        return True

    def _say(self, key: str, why: str) -> None:
        """One log line per reason (INFO the first time, DEBUG after)."""
        log.log(logging.DEBUG if key in self._said else logging.INFO, "fetch by IPC: %s; fetching the next way", why)
        self._said.add(key)


def held_request(ack) -> dict:
    """A held fetch's "ipc", acknowledging `ack` (tokens of copies done under that server's earlier holds)."""
    return IpcRequest(this_host(), hold=True, ack=tuple(ack)).to_dict()


def _ack(answer: IpcPlacement, acks: Acks) -> None:
    if answer.token is not None:
        acks.add(answer.token)
