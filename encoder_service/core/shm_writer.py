"""Server side of the shared-memory fetch: write a chunk's rows into a co-located client's file.

A fetch may name a `ShmTarget(name, offset, by_position)` (protocol/shm.py: the name rule and where the
rows go): a file the CLIENT created and owns in `--shm-dir` (client/shm.py). The core hands the chunk's
row tensors here and answers only the header; the bytes never cross a socket (TCP through Python is
~16-36 ms for a 19 MB 1080p chunk, a parallel memcpy into a mapping ~1-3 ms).

The file is the client's: it is checked strictly, and never grown or truncated here (so a request can't
make the server allocate): the name is a bare `encoder-fetch-<32 hex>` opened relative to the shm dir's
fd with O_NOFOLLOW (no paths, no symlinks), it must be a regular file, and the whole write must fit
inside its current size. Trust: the file is mode 0600, so only a client running as the server's own uid
can hand one over (it could signal the server anyway); a client that shrinks its file during a write
crashes the server with SIGBUS, which that uid could do by other means too.

Mappings are kept in a small LRU keyed by (name, st_dev, st_ino, st_size) and re-stat'ed per request,
so a reused client file stays mapped and its pages stay faulted in on this side too. Copies run on a
small dedicated thread pool (`Tensor.copy_` releases the GIL and is itself multi-threaded), not on the
engine's CPU pool, which is busy preprocessing under load.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from encoder_service.errors import FailedPrecondition, InvalidInput
from encoder_service.protocol.shm import NAME_RE, ShmTarget

MAX_OPEN = 16  # mappings kept open (a client reuses one file; a few clients per host)
COPY_THREADS = 2
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO never hangs us


def disabled() -> FailedPrecondition:
    return FailedPrecondition("shared-memory fetch is off on this server: start it with --shm-fetch "
                              "(ENCODER_SHM_FETCH=true), or fetch without shm")


class _Mapping:
    """One client file mapped MAP_SHARED; `users` copies in flight (closed only at zero)."""

    def __init__(self, key: tuple, fd: int, size: int):
        self.key, self.size = key, size
        self.fd = os.dup(fd)  # for posix_fallocate before each write (see _copy)
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # torch.frombuffer holds a reference to the mmap, not a buffer export: mm.close() would succeed under a
        # live view and unmap it. Hence `users`: nothing closes a mapping while a copy may touch it.
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)  # [size]
        self.users, self.evicted = 0, False
        self.sparse = True  # the file had holes at the last check (see ShmWriter.check)

    def close(self) -> None:
        self.bytes = None
        self.mm.close()
        os.close(self.fd)


class ShmWriter:
    """`m = writer.check(target, extent)`, then `await writer.write(m, target.offset, [(at, rows), ...])` (or
    `writer.release(m)` when nothing is written); `close()` at shutdown. Bookkeeping on the event loop,
    copies on the pool; `_lock` covers what the pool's done-callbacks touch."""

    def __init__(self, directory: str, *, max_open: int = MAX_OPEN, threads: int = COPY_THREADS):
        self.directory = directory  # (settings.py checked it at start-up)
        self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._max_open = max_open
        self._open: OrderedDict[tuple, _Mapping] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shm-copy")
        self.counters = dict(opens=0, evictions=0, writes=0, written_bytes=0, copy_seconds=0.0)

    def check(self, target: ShmTarget, extent: int) -> _Mapping:
        """Validate `target` for a write of `extent` bytes from its offset; the mapping, with one more user
        (hand it to `write`, or `release` it). Raises InvalidInput naming the problem."""
        if target.offset < 0:
            raise InvalidInput(f"shm offset must be >= 0, got {target.offset}")
        name = target.name
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidInput(f"shm name {name!r:.80} is invalid: expected a bare file name "
                               "encoder-fetch-<32 lowercase hex> (no directories)")
        try:
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise InvalidInput(f"shm file {name} not found in {self.directory}: client and server must share "
                               "that directory (same host, same pod or a shared mount)") from None
        except OSError as exc:
            raise InvalidInput(f"shm file {name}: {exc.strerror}") from None
        key = (name, st.st_dev, st.st_ino, st.st_size)
        with self._lock:
            m = self._open.get(key) if stat.S_ISREG(st.st_mode) else None
            if m is not None:
                self._open.move_to_end(key)
                m.users += 1
        if m is None:
            m = self._map(name)  # also refuses what is not a regular file (S_ISLNK above, anything else)
        # Holes in the file: reserve the range before writing (_copy). Our client reserves every page at
        # creation, so this is normally False and the write costs one stat, not a fallocate per fetch.
        m.sparse = st.st_blocks * 512 < st.st_size
        if target.offset + extent > m.size:
            self.release(m)
            raise InvalidInput(f"shm file {name} is {m.size} bytes; this fetch writes {extent} bytes at offset "
                               f"{target.offset} (needs {target.offset + extent}): grow the file")
        return m

    def _map(self, name: str) -> _Mapping:
        try:
            fd = os.open(name, _OPEN_FLAGS, dir_fd=self._dir_fd)
        except OSError as exc:
            why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise InvalidInput(f"shm file {name} in {self.directory} can't be opened: {why}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInput(f"shm file {name} is not a regular file")
            if st.st_size == 0:
                raise InvalidInput(f"shm file {name} is empty: the client sizes it (ftruncate) before fetching")
            m = _Mapping((name, st.st_dev, st.st_ino, st.st_size), fd, st.st_size)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        with self._lock:
            # A file of the same name with another inode or size is gone or was replaced: drop its mapping.
            for old in [k for k in self._open if k[0] == name]:
                self._evict(old)
            self._open[m.key] = m
            m.users += 1
            while len(self._open) > self._max_open:
                self._evict(next(iter(self._open)))
        self.counters["opens"] += 1
        return m

    def _evict(self, key: tuple) -> None:  # under _lock
        m = self._open.pop(key)
        m.evicted = True
        self.counters["evictions"] += 1
        if m.users == 0:
            m.close()

    def release(self, m: _Mapping) -> None:
        with self._lock:
            m.users -= 1
            if m.evicted and m.users == 0 and m.bytes is not None:
                m.close()

    async def write(self, m: _Mapping, offset: int, pieces: list[tuple[int, torch.Tensor]]) -> int:
        """Copy each (byte offset from `offset`, rows tensor) into the mapping on the copy pool; releases `m`
        (also when cancelled: the release waits for a copy already running). Returns the bytes written."""
        try:
            future = self._pool.submit(_copy, m, offset, pieces, self.directory)
        except BaseException:
            self.release(m)
            raise
        future.add_done_callback(lambda _: self.release(m))
        self.counters["writes"] += 1
        written, seconds = await asyncio.wrap_future(future)
        self.counters["written_bytes"] += written
        self.counters["copy_seconds"] += seconds
        return written

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, open=len(self._open))

    def close(self) -> None:
        """Wait for copies in flight, then unmap everything (the files stay: they are the clients')."""
        self._pool.shutdown(wait=True)
        with self._lock:
            for m in self._open.values():
                m.close()
            self._open.clear()
        os.close(self._dir_fd)


def _copy(m: _Mapping, offset: int, pieces: list[tuple[int, torch.Tensor]], directory: str) -> tuple[int, float]:
    """Pool thread: each piece's rows as raw bytes into the mapping at offset + at; no concatenation.
    Returns (bytes written, seconds the copies took).

    A file with holes gets its range allocated first: a sized tmpfs file can be sparse, and a store into a
    page the filesystem can't back (a full /dev/shm: Docker's default is 64 MiB) would kill the process with
    SIGBUS. posix_fallocate answers ENOSPC instead, and never grows the file (the range is inside its size)."""
    extent = max((at + rows.numel() * rows.element_size() for at, rows in pieces), default=0)
    if extent and m.sparse:
        try:
            os.posix_fallocate(m.fd, offset, extent)
        except OSError as exc:
            raise FailedPrecondition(f"shm file {m.key[0]}: no room for {extent} bytes in {directory} "
                                     f"({exc.strerror}); give the shared-memory mount more space") from None
    total, t0 = 0, time.perf_counter()
    for at, rows in pieces:
        src = rows.detach().reshape(-1).view(torch.uint8)  # contiguous rows: a view
        lo = offset + at
        m.bytes[lo:lo + src.numel()].copy_(src)
        total += src.numel()
    return total, time.perf_counter() - t0
