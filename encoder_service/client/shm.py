"""Client side of the shared-memory fetch: the files a client owns (the target both ends agree on:
protocol/shm.py; the server's writer: core/shm_writer.py).

A client built with `shm=True` creates files `<shm_dir>/encoder-fetch-<32 hex>` (O_CREAT|O_EXCL, mode
0600, ftruncate'd, mapped MAP_SHARED); a fetch names one (`ShmTarget` name + offset) and the server writes
the rows into it, answering only the header. Two kinds of file:
  - staging: a fetch whose `out` is not in one of our files gets the packed rows in a staging file, then
    one copy into `out` (or into a new tensor). Reused across fetches, so pages stay faulted in on both
    sides; replaced by a larger file (the old one unlinked) when a chunk needs more; one per fetch in flight.
  - `alloc_rows(num_rows, row_width, dtype)`: a tensor in a file of its own; fetch(out=it, or a row slice
    of it) has the server write each segment at its row `position - start`: no copy on the client.
Every file is unlinked on `close()` (or once nothing maps it any more). A mapping stays valid while any
tensor views it (torch.frombuffer keeps the mmap object alive), so tensors handed out survive close().

A process killed before it unlinks its files (SIGKILL: vLLM force-kills its engine core, where the connector's
files are, at shutdown; the OOM killer) would leave them in the shm dir, a memory-backed tmpfs, for good. So
a file's name says who made it, `encoder-fetch-<pid namespace: 8 hex><pid: 6><start time: 10><random: 8>`
(still the 32 hex of protocol/shm.py's rule), and every `ShmBuffers` sweeps the directory when it opens it:
a file made in our pid namespace whose process has ended (no such pid, or one with another start time) is
unlinked (`sweep`). Names made elsewhere (another pid namespace, whose pids mean nothing here; another
uid's files) are left alone.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import stat
import threading
import weakref
from dataclasses import dataclass

import torch

from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.shm import DEFAULT_DIR, NAME_RE, PREFIX

log = logging.getLogger("encoder_service.client")

IDLE_STAGING = 2  # staging files kept for reuse when no fetch uses them (more only while fetches overlap)
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot: /proc/<pid>/stat field 22), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    return int(stat_line[stat_line.rindex(b")") + 2:].split()[19])  # fields from 3 on follow "(comm) "


_OWNER: dict[int, str | None] = {}  # pid -> this process's owner tag (a fork gets its own)


def owner_tag() -> str | None:
    """`<pid namespace><pid><start time>` in hex (24 digits) for this process; None where /proc can't tell
    (then names are random and no sweep removes them)."""
    pid = os.getpid()
    if pid not in _OWNER:
        try:
            namespace = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            namespace = None
        start = _start_time(pid)
        fits = namespace is not None and start is not None and namespace < 16**8 and pid < 16**6 and start < 16**10
        _OWNER[pid] = f"{namespace:08x}{pid:06x}{start:010x}" if fits else None
    return _OWNER[pid]


def new_file_name() -> str:
    """A fresh name for a file of this process: its owner tag and 32 random bits (all random without one)."""
    tag = owner_tag()
    return PREFIX + (tag + secrets.token_hex(4) if tag else secrets.token_hex(16))


def sweep(directory: str) -> list[str]:
    """Unlink the files in `directory` that a process of our pid namespace made and left when it ended (its
    pid gone, or reused by a process that started at another time); only regular files of our uid. Returns
    their names."""
    tag = owner_tag()
    if tag is None:
        return []
    removed = []
    for name in os.listdir(directory):
        owner = name[len(PREFIX):]
        if not NAME_RE.match(name) or owner[:8] != tag[:8]:
            continue
        if _start_time(int(owner[8:14], 16)) == int(owner[14:24], 16):
            continue  # its owner runs
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(name)
        except OSError:  # gone meanwhile (another sweep), or not ours to remove
            continue
    return removed


@dataclass(eq=False)
class ShmFile:
    """One file we created, mapped. `data`: uint8 [size] over the mapping (None once dropped)."""

    name: str
    size: int
    base: int  # address of byte 0 in this process
    data: torch.Tensor | None
    unlink: weakref.finalize  # unlinks the file: at close(), or when the mapping is collected

    @classmethod
    def create(cls, directory: str, nbytes: int) -> ShmFile:
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        for _ in range(4):  # our own names: a clash is one of our files (32 random bits) or someone writing them
            path = os.path.join(directory, new_file_name())
            try:
                fd = os.open(path, _CREATE_FLAGS, 0o600)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"could not create a fresh {PREFIX}* file in {directory}")
        try:
            os.ftruncate(fd, size)
            # Back every page now: a sparse tmpfs file on a full mount would SIGBUS whoever touches the
            # missing page (the server, mid-write); this fails here instead, with ENOSPC.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        data = torch.frombuffer(mm, dtype=torch.uint8)
        return cls(os.path.basename(path), size, data.data_ptr(), data, weakref.finalize(mm, _unlink, path))

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Byte offset of CPU tensor `t` in this file when all of it lies inside, else None."""
        lo = t.data_ptr() - self.base
        end = lo + t.numel() * t.element_size()
        return lo if self.unlink.alive and 0 <= lo and end <= self.size else None


class ShmBuffers:
    """The shared-memory files of one client. Thread-safe (a blocking client may be shared by threads)."""

    def __init__(self, directory: str = DEFAULT_DIR):
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"shm_dir {directory!r} is not a directory (the server's --shm-dir, shared)")
        self.directory = directory
        swept = sweep(directory)
        if swept:
            log.info("removed %d shared-memory file(s) in %s left by processes that have ended: %s", len(swept),
                     directory, " ".join(swept))
        self._lock = threading.Lock()
        self._idle: list[ShmFile] = []  # staging files no fetch is using
        self._busy: set[ShmFile] = set()  # staging files a fetch is using
        self._allocated: list[ShmFile] = []  # alloc_rows files (their `data` dropped: the tensors hold the maps)
        self._closed = False

    def alloc_rows(self, num_rows: int, row_width: int, dtype: torch.dtype | str) -> torch.Tensor:
        """A zeroed [num_rows, row_width] tensor in a new file of ours: use it (or row slices) as fetch `out`."""
        dtype = torch_dtype(dtype)
        nbytes = num_rows * row_width * dtype.itemsize
        if self._closed:
            raise RuntimeError("the client's shared memory is closed")
        f = self._new(nbytes)
        rows = f.data[:nbytes].view(dtype).view(num_rows, row_width)
        f.data = None  # the file lives as long as `rows` (or a view of it) does
        with self._lock:
            self._allocated = [a for a in self._allocated if a.unlink.alive] + [f]
        return rows

    def locate(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(file name, byte offset) when CPU tensor `t` lies inside an alloc_rows file, else None."""
        if t.device.type != "cpu":
            return None
        with self._lock:
            for f in self._allocated:
                offset = f.offset_of(t)
                if offset is not None:
                    return f.name, offset
        return None

    def take_staging(self, nbytes: int) -> ShmFile:
        """A staging file of at least `nbytes` for one fetch; give it back with `give_staging`."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the client's shared memory is closed")
            fit = [f for f in self._idle if f.size >= nbytes]
            if fit:
                f = min(fit, key=lambda f: f.size)
                self._idle.remove(f)
                self._busy.add(f)
                return f
            if self._idle:  # too small for this chunk: replace the largest idle one by a bigger file
                old = max(self._idle, key=lambda f: f.size)
                self._idle.remove(old)
                old.unlink()
                nbytes = max(nbytes, 2 * old.size)  # grow geometrically: chunks vary a little in size
        f = self._new(nbytes)
        with self._lock:
            self._busy.add(f)
        return f

    def give_staging(self, f: ShmFile, reuse: bool = True) -> None:
        """Back to the idle list; `reuse=False` (the fetch failed: the server may still write) unlinks it."""
        with self._lock:
            self._busy.discard(f)
            if not reuse or self._closed or len(self._idle) >= IDLE_STAGING:
                f.unlink()
                f.data = None
            else:
                self._idle.append(f)

    def files(self) -> list[str]:
        """Names of the files this client has in the shm dir now."""
        with self._lock:
            every = self._idle + list(self._busy) + self._allocated
            return [f.name for f in every if f.unlink.alive]

    def close(self) -> None:
        """Unlink every file (tensors from alloc_rows stay valid: their mappings live on until dropped)."""
        with self._lock:
            self._closed = True
            for f in self._idle + list(self._busy) + self._allocated:
                f.unlink()
            for f in self._idle:
                f.data = None
            self._idle, self._allocated = [], []

    def _new(self, nbytes: int) -> ShmFile:
        try:
            return ShmFile.create(self.directory, nbytes)
        except OSError as exc:
            raise OSError(exc.errno, f"can't create a shared-memory file in {self.directory}: {exc.strerror}") \
                from exc
