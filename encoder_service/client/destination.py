"""Where a fetch's rows land on the client, whatever the transport (protocol/wire.py: RowWriter does the writing).

- No `out`: a new [num_rows, row_width] tensor the socket reads into.
- `out` a contiguous CPU tensor of the payload's dtype: each segment's bytes straight at its row
  `position - start` (no copy on the client).
- `out` on a CUDA device: the packed rows into a reusable page-locked (pinned) staging buffer, then one
  host-to-device copy per segment (synchronous: the buffer is free again when the fetch returns).
- any other `out` (another dtype, strided): staged in a new CPU tensor, then copied (casting).
"""

from __future__ import annotations

import threading

import torch

from encoder_service.protocol.wire import RowWriter, WireHeader

PINNED_ROUND_BYTES = 4 << 20  # sizes rounded up so chunks of similar size reuse one buffer
PINNED_IDLE = 4  # idle pinned buffers kept (more exist only while that many fetches to CUDA overlap)


class PinnedBuffers:
    """Reusable pinned host buffers (each allocation costs milliseconds of cudaHostAlloc). Thread-safe."""

    def __init__(self, max_idle: int = PINNED_IDLE):
        self._max_idle, self._idle, self._lock = max_idle, [], threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 pinned tensor of >= nbytes: the smallest idle one that fits, else a new one."""
        with self._lock:
            fits = [b for b in self._idle if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._idle.remove(buf)
                return buf
        size = max(PINNED_ROUND_BYTES, -(-nbytes // PINNED_ROUND_BYTES) * PINNED_ROUND_BYTES)
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buf)
            if len(self._idle) > self._max_idle:  # drop the smallest: the large ones are the costly ones
                self._idle.remove(min(self._idle, key=torch.Tensor.numel))

    def close(self) -> None:
        with self._lock:
            self._idle.clear()


class Destination:
    """One fetch's destination: `writer(header)` once the header is known, then the transport feeds the
    writer; `finish()` gives the rows (the caller's `out`, or a new tensor); `close()` in every case."""

    def __init__(self, out: torch.Tensor | None, start: int, pinned: PinnedBuffers):
        self._out, self._start, self._pinned = out, start, pinned
        self._staging: torch.Tensor | None = None
        self._writer: RowWriter | None = None

    def writer(self, header: WireHeader) -> RowWriter:
        """The writer for a payload with `header` (again after a failed attempt: a new writer, same buffers)."""
        cuda = self._out is not None and self._out.device.type == "cuda" and header.payload_bytes > 0
        if cuda and (self._staging is None or self._staging.numel() < header.payload_bytes):
            self.close()
            self._staging = self._pinned.take(header.payload_bytes)
        self._writer = RowWriter(header, self._out, self._start, self._staging)
        return self._writer

    def finish(self) -> torch.Tensor:
        return self._writer.finish()

    def abandon(self) -> None:
        """The fetch was cancelled while a thread may still write into the staging buffer: never reuse it."""
        self._staging = None

    def close(self) -> None:
        if self._staging is not None:
            self._pinned.give(self._staging)
            self._staging = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
