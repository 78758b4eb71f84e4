"""Where a fetch's rows land on the client, whatever the transport (protocol/wire.py: RowWriter does the writing).

- No `out`: a [num_rows, row_width] tensor the socket reads into, the caller's to keep, on memory of the
  client's `HostRowPool` (rowpath/host_pool.py): fresh pages cost a page fault per 4 KiB at their first
  touch, which made such fetches several times slower than into a preallocated `out` (transfer_bench.py's
  "no out" variants), so the pool hands out again the pages of rows the caller has dropped (never while
  any view of them lives).
- `out` a contiguous CPU tensor of the payload's dtype: each segment's bytes straight at its row
  `position - start` (no copy on the client).
- any other `out` (on a CUDA device, of another dtype, strided): the packed rows into a staging buffer the
  client reuses (`StagingBuffers`: page-locked for a CUDA `out`, so each host-to-device copy is one DMA),
  then one copy per segment (casting) into `out`. The copies are synchronous: the buffer is free again when
  the fetch returns. CPU and CUDA `out`s take the same path, so CI covers the one a GPU runs.
"""

from __future__ import annotations

import threading

import torch

from encoder_service.protocol.dtypes import DTYPES
from encoder_service.protocol.wire import RowWriter, WireHeader, is_direct
from encoder_service.rowpath.host_pool import HostRowPool

STAGING_ROUND_BYTES = 4 << 20  # sizes rounded up so chunks of similar size reuse one buffer
STAGING_IDLE = 4  # idle buffers kept (more exist only while that many staged fetches overlap)
STAGING_IDLE_BYTES = 512 << 20  # and at most this many bytes of them (a 4096-row chunk of 32 KiB rows is 128 MiB)


class StagingBuffers:
    """Reusable host buffers for staged fetches (a pinned allocation costs milliseconds of cudaHostAlloc, a
    fresh pageable one a page fault per 4 KiB). A buffer belongs to one fetch (one stream of a split fetch)
    from `take` to `give`: fetches that overlap, from threads or split streams, never share one. Idle ones
    are bounded by count and bytes. Thread-safe."""

    def __init__(self, max_idle: int = STAGING_IDLE, max_idle_bytes: int = STAGING_IDLE_BYTES):
        self._max_idle, self._max_idle_bytes = max_idle, max_idle_bytes
        self._idle: list[tuple[bool, torch.Tensor]] = []  # (pinned, uint8 buffer), smallest first
        self._lock = threading.Lock()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 CPU tensor of >= nbytes, page-locked or not as asked: the smallest idle one that fits,
        else a new one."""
        with self._lock:
            for k, (p, buf) in enumerate(self._idle):
                if p == pinned and buf.numel() >= nbytes:
                    del self._idle[k]  # by position: list.remove would compare tensors with ==
                    return buf
        size = max(STAGING_ROUND_BYTES, -(-nbytes // STAGING_ROUND_BYTES) * STAGING_ROUND_BYTES)
        return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)

    def give(self, buf: torch.Tensor, pinned: bool) -> None:
        """Back for reuse; past the bounds the smallest idle ones are dropped (the large ones cost the most)."""
        with self._lock:
            self._idle.append((pinned, buf))
            self._idle.sort(key=lambda e: e[1].numel())
            while len(self._idle) > self._max_idle or sum(b.numel() for _, b in self._idle) > self._max_idle_bytes:
                del self._idle[0]

    def idle(self) -> list[torch.Tensor]:
        """The idle buffers, smallest first (what a test or a benchmark inspects)."""
        with self._lock:
            return [buf for _, buf in self._idle]

    def close(self) -> None:
        with self._lock:
            self._idle.clear()


class Destination:
    """One fetch's destination: `writer(header)` once the header is known, then the transport feeds the
    writer; `finish()` gives the rows (the caller's `out`, or a tensor on memory of `rows`); `close()` in
    every case."""

    def __init__(self, out: torch.Tensor | None, start: int, buffers: StagingBuffers, rows: HostRowPool):
        self._out, self._start, self._buffers, self._rows = out, start, buffers, rows
        self._pinned = out is not None and out.device.type == "cuda"
        self._staging: torch.Tensor | None = None
        self._writer: RowWriter | None = None

    def writer(self, header: WireHeader) -> RowWriter:
        """The writer for a payload with `header` (again after a failed attempt: a new writer, and the same
        staging buffer when it is large enough)."""
        if self._out is None:  # the caller's rows: memory back in the pool once the caller drops them
            self._writer = RowWriter(header, None, self._start, self._rows.take(header.payload_bytes))
            return self._writer
        staged = header.payload_bytes > 0 and not is_direct(self._out, DTYPES[header.dtype])
        if staged and (self._staging is None or self._staging.numel() < header.payload_bytes):
            self.close()
            self._staging = self._buffers.take(header.payload_bytes, self._pinned)
        self._writer = RowWriter(header, self._out, self._start, self._staging if staged else None)
        return self._writer

    def finish(self) -> torch.Tensor:
        return self._writer.finish()

    def abandon(self) -> None:
        """The fetch was cancelled while a thread may still write into the staging buffer: never reuse it."""
        self._staging = None

    def close(self) -> None:
        if self._staging is not None:
            self._buffers.give(self._staging, self._pinned)
            self._staging = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
