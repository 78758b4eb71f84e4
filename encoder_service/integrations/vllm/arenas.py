"""Host staging, scheduler side: items' rows in ranges of a few large shared-memory files (arenas) that the
encoder writes into (shm) or our client fills from the socket, and that every worker maps (worker.py).

An arena is 128 MiB of a memory-backed tmpfs, so none may outlive the connector. `close` (vLLM's connector
`shutdown`) unlinks them, but vLLM runs it only when its engine core exits on its own: with vLLM's default
`--shutdown-timeout 0` the API server SIGKILLs the engine core at once. Two nets catch that: in /dev/shm each
arena is left to multiprocessing's resource tracker (the process Python runs to unlink the shared memory of
processes that died; vLLM's API server runs one, which its engine core shares), which unlinks it when vLLM's
processes have exited; in any directory, the next `ShmBuffers` there removes the files of ended processes
(client/shm.py: `sweep`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Callable

import torch

from encoder_service.integrations.vllm.worker import IpcRows, ShmRows
from encoder_service.protocol.dtypes import torch_dtype


@dataclass(eq=False)
class _Arena:
    rows: torch.Tensor  # [capacity, width] in a shared-memory file of ours
    name: str
    free: list[list[int]]  # sorted [start, length] runs of free rows
    used: int = 0

    def take(self, n: int) -> int | None:
        for run in self.free:
            if run[1] >= n:
                start = run[0]
                run[0] += n
                run[1] -= n
                if run[1] == 0:
                    self.free.remove(run)
                self.used += n
                return start
        return None

    def give(self, start: int, n: int) -> None:
        self.used -= n
        self.free.append([start, n])
        self.free.sort()
        merged = [self.free[0]]
        for s, length in self.free[1:]:
            if merged[-1][0] + merged[-1][1] == s:
                merged[-1][1] += length
            else:
                merged.append([s, length])
        self.free = merged


@dataclass(eq=False)
class StagedRows:
    """One item's rows in an arena: `rows` is the `[num_rows, row_width]` view, `ref` what a worker needs. Rows
    left on the encoder's GPU (fetch.py, by IPC) have no arena here: `rows` and `arena` None, `ref` an IpcRows."""

    item_id: str
    rows: torch.Tensor | None
    ref: ShmRows | IpcRows
    arena: _Arena | None
    start: int
    span: int  # rows taken in the arena (num_rows + 1: the guard row)

    @property
    def nbytes(self) -> int:
        """Bytes staged in our host memory (none for rows left on the encoder's GPU)."""
        return self.ref.nbytes if self.arena is not None else 0


class RowArenas:
    """Row ranges in a few large shared-memory files (`ShmBuffers.alloc_rows`), reused item after item: the
    encoder keeps each file mapped (its pages faulted in once), and so does every worker (RowLoader).

    A new arena holds max(arena_bytes, the item) and is created only when no arena has room; an arena that
    empties is unlinked unless it is the only one. Ranges of a failed fetch are quarantined for `quarantine_s`
    (the encoder may still be writing a timed-out fetch into them). Thread-safe."""

    def __init__(self, buffers, arena_bytes: int, quarantine_s: float, clock: Callable[[], float] = time.monotonic):
        self._buffers, self.arena_bytes, self.quarantine_s, self._clock = buffers, arena_bytes, quarantine_s, clock
        # POSIX shared memory names are files of /dev/shm: only there can the resource tracker unlink ours.
        self._tracked = os.path.realpath(buffers.directory) == "/dev/shm"
        self._lock = threading.Lock()
        self._arenas: list[_Arena] = []
        self._quarantine: list[tuple[float, _Arena, int, int]] = []

    def take(self, num_rows: int, width: int, dtype: str) -> tuple[_Arena, int]:
        with self._lock:
            self._thaw()
            for arena in self._arenas:
                if arena.rows.shape[1] == width and arena.rows.dtype == torch_dtype(dtype):
                    start = arena.take(num_rows)
                    if start is not None:
                        return arena, start
            capacity = max(num_rows, self.arena_bytes // (width * torch_dtype(dtype).itemsize))
            rows = self._buffers.alloc_rows(capacity, width, dtype)
            arena = _Arena(rows, self._buffers.locate(rows)[0], [[0, capacity]])
            self._arenas.append(arena)
            if self._tracked:
                resource_tracker.register("/" + arena.name, "shared_memory")
            return arena, arena.take(num_rows)

    def give(self, arena: _Arena, start: int, n: int, quarantine: bool = False) -> None:
        with self._lock:
            if quarantine:
                self._quarantine.append((self._clock() + self.quarantine_s, arena, start, n))
                return
            arena.give(start, n)
            if arena.used == 0 and len(self._arenas) > 1 and not any(q[1] is arena for q in self._quarantine):
                self._forget(arena)  # the last view: the file is unlinked once its mapping goes

    def names(self) -> list[str]:
        with self._lock:
            return [a.name for a in self._arenas]

    def close(self) -> None:
        """Drop every arena (the caller closes the ShmBuffers, which unlinks the files)."""
        with self._lock:
            for arena in list(self._arenas):
                self._forget(arena)
            self._quarantine = []

    def _forget(self, arena: _Arena) -> None:  # under _lock
        self._arenas.remove(arena)
        if self._tracked:
            resource_tracker.unregister("/" + arena.name, "shared_memory")

    def _thaw(self) -> None:  # under _lock
        now = self._clock()
        thawed = [q for q in self._quarantine if q[0] <= now]
        self._quarantine = [q for q in self._quarantine if q[0] > now]
        for _, arena, start, n in thawed:
            arena.give(start, n)
