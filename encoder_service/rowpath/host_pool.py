"""Host memory for a batch's rows (runtime/transfer.py copies them out of the pinned staging buffer into it),
handed back and reused when the last tensor on it is gone, instead of fresh pages every time.

Why: fresh memory costs a page fault per 4 KiB page at its first touch (the kernel zeroes and maps it). The
rows of four Qwen3 720p images are 115 MB, ~28,000 faults: on the H100 host the copy out of staging took 70 ms
in one thread and 7.6 ms over torch's intra-op threads, 3.6 ms into memory already touched (RESULTS.md, issue
23). glibc serves blocks that large with their own mappings and unmaps them when freed, so a cache at its
capacity, which frees an entry for every new one, pays the faults again for every image.

`HostRowPool.take(nbytes)` -> a uint8 tensor of exactly `nbytes` on an anonymous mapping of its own (pages
rounded up). The tensor's storage holds the memoryview it was made from (torch.frombuffer keeps the object
until the storage is freed), and every view, slice or numpy array of the tensor holds the storage: when the
last of them is gone the memoryview dies, a finalizer on it gives the mapping back, and a later `take` of
about that size reuses its touched pages, resized in place (mremap: the pages kept move with it; only the
difference is faulted or unmapped). A mapping is never handed out while anything refers to it.

Bounds: mappings waiting for reuse hold at most `max_idle_bytes` (the oldest go back to the kernel first);
rows under `min_bytes` come from torch's allocator (glibc reuses its heap for small blocks, and one mapping
each would spend the process's map count, vm.max_map_count). `min_bytes=math.inf`: never pooled (every row
from torch's allocator, what the service did before the pool).

Ahead of need (`prefault_bytes`): until a cache is full it frees nothing, so every image's rows are fresh
pages, faulted in on the copy that the answer waits for (a Qwen3 1080p image's 66.8 MB: ~16,000 faults). A
background thread keeps up to `prefault_bytes` of idle mappings faulted in, whole mappings each the size of the
largest recent `take`, a byte written per page by torch, so without the GIL (MAP_POPULATE would hold it through
the whole mmap call: 256 MiB stopped every other thread for 139 ms on a 2-core host). `take` uses them as it
uses given-back ones (a smaller take gets one cut down to its size, in place). `close` ends the thread.

The client (client/destination.py) takes the rows of a fetch without `out` from one too: a caller that drops
each chunk's rows before the next fetch reads into pages already touched.

Thread safety: `take` may run on several threads at once (the server's completion thread; the client's
fetch threads); mappings come back on whichever thread drops the last reference, possibly inside `take`
itself (a garbage collection there). A returning mapping is queued and filed by whoever holds the lock,
never waiting for it.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref

import torch

PAGE = mmap.PAGESIZE
DEFAULT_MAX_IDLE_BYTES = 256 << 20  # about two of the largest batches (16384 patches of Qwen3: 134 MB of rows)
DEFAULT_MIN_BYTES = 4 << 20
_RECENT = 8  # takes whose largest size the prefaulted mappings get


class HostRowPool:
    def __init__(self, *, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES, min_bytes: float = DEFAULT_MIN_BYTES,
                 huge_pages: bool = False, prefault_bytes: int = 0):
        """`huge_pages`: advise transparent huge pages on new mappings (MADV_HUGEPAGE: one fault per 2 MiB
        where the kernel grants them; with THP defrag "madvise", its default, a fault may stall in direct
        compaction when memory is fragmented). Off unless measured to pay on the host. `prefault_bytes`: idle
        mappings kept faulted in ahead of `take` by a background thread (at most `max_idle_bytes`; 0: none)."""
        self.max_idle_bytes, self.min_bytes, self.huge_pages = max_idle_bytes, min_bytes, huge_pages
        self.prefault_bytes = min(prefault_bytes, max_idle_bytes)
        self._idle: list[mmap.mmap] = []  # oldest first
        self._idle_bytes = 0
        self._returned: collections.deque[mmap.mmap] = collections.deque()  # given back, not filed yet
        self._lock = threading.Lock()
        self._recent: collections.deque[int] = collections.deque(maxlen=_RECENT)  # sizes of the last takes
        self._wanted = threading.Event()  # set by take: the prefault thread looks whether to map more
        self._prefaulter: threading.Thread | None = None
        self._closed = False
        self.taken = {"reused": 0, "fresh": 0, "small": 0}  # take() calls by where the memory came from
        self.prefaulted = 0  # mappings the prefault thread made
        self.prefault_passes = 0  # times it looked whether to make one (under the lock)

    def take(self, nbytes: int) -> torch.Tensor:
        """An owned, contiguous uint8 CPU tensor of `nbytes` (contents undefined)."""
        if nbytes < self.min_bytes or nbytes == 0:  # (a mapping cannot be empty)
            self._count("small")
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // PAGE) * PAGE
        block = self._reuse(size)
        self._count("reused" if block is not None else "fresh")
        if block is None:
            block = self._map(size)
        if self.prefault_bytes:
            with self._lock:  # (the prefault thread reads them under it)
                self._recent.append(size)
            self._prefault_soon()
        view = memoryview(block)[:nbytes]
        tensor = torch.frombuffer(view, dtype=torch.uint8)  # the storage holds `view` until it is freed
        weakref.finalize(view, self._give_back, block).atexit = False
        return tensor

    def stats(self) -> dict:
        """take() calls by where the memory came from (reused / fresh mapping / small: torch's allocator) and
        the mappings waiting for reuse."""
        self._file_returned()
        with self._lock:
            return dict(self.taken, idle_mappings=len(self._idle), idle_bytes=self._idle_bytes,
                        prefaulted=self.prefaulted)

    def close(self, timeout_s: float = 10.0) -> None:
        """The idle mappings go back to the kernel, and so will those given back from now on; the prefault
        thread ends (joined, up to `timeout_s`: it may be faulting a mapping in)."""
        with self._lock:
            self.max_idle_bytes = 0
            self._closed = True
            self._file_locked()
            thread = self._prefaulter
        self._wanted.set()
        if thread is not None:
            thread.join(timeout_s)

    def _map(self, size: int) -> mmap.mmap:
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            block.madvise(mmap.MADV_HUGEPAGE)
        return block

    def _prefault_soon(self) -> None:
        if self._prefaulter is None:
            with self._lock:
                if self._prefaulter is None and not self._closed:
                    self._prefaulter = threading.Thread(target=self._prefault_loop, name="host-row-prefault",
                                                        daemon=True)
                    self._prefaulter.start()
        self._wanted.set()

    def _prefault_loop(self) -> None:
        """Map (and fault in) mappings of the largest recent take's size while the idle ones hold less than
        prefault_bytes; then wait for the next take."""
        while True:
            self._wanted.wait()
            self._wanted.clear()
            while True:
                self._file_returned()
                with self._lock:
                    self.prefault_passes += 1
                    if self._closed:
                        return
                    size = max(self._recent, default=0)
                    if not size or self._idle_bytes + size > self.prefault_bytes:
                        break
                try:
                    block = self._map(size)
                    _fault_in(block)
                except (OSError, RuntimeError):  # out of memory for now: the takes fault their own pages
                    break
                with self._lock:
                    self.prefaulted += 1
                    self._idle.append(block)
                    self._idle_bytes += len(block)
                    self._file_locked()  # (bounded by max_idle_bytes, like any idle mapping)

    def _count(self, source: str) -> None:
        with self._lock:  # (several threads may take at once: no count lost)
            self.taken[source] += 1

    def _reuse(self, size: int) -> mmap.mmap | None:
        """An idle mapping resized to `size`: the smallest at least that big, else the biggest (grown)."""
        with self._lock:
            self._file_locked()
            bigger = [b for b in self._idle if len(b) >= size]
            block = min(bigger, key=len) if bigger else max(self._idle, key=len, default=None)
            if block is not None:
                self._idle.remove(block)
                self._idle_bytes -= len(block)
        self._file_returned()  # what came back while the lock was held here
        if block is not None and len(block) != size:
            try:
                block.resize(size)
            except (OSError, ValueError, SystemError):  # no mremap here: a fresh mapping instead
                block.close()
                return None
        return block

    def _give_back(self, block: mmap.mmap) -> None:
        self._returned.append(block)
        self._file_returned()

    def _file_returned(self) -> None:
        """File the mappings given back into the idle list, if the lock is free (its holder files them)."""
        while self._returned and self._lock.acquire(blocking=False):
            try:
                self._file_locked()
            finally:
                self._lock.release()

    def _file_locked(self) -> None:
        while self._returned:
            block = self._returned.popleft()
            self._idle.append(block)
            self._idle_bytes += len(block)
        while self._idle_bytes > self.max_idle_bytes:
            block = self._idle.pop(0)
            self._idle_bytes -= len(block)
            block.close()


def _fault_in(block: mmap.mmap) -> None:
    """Every page of `block` mapped in: one byte written per page, by torch (which lets go of the GIL, and
    keeps no buffer export of `block` past frombuffer: a later resize is free to move it)."""
    torch.frombuffer(block, dtype=torch.uint8)[::PAGE].fill_(0)
