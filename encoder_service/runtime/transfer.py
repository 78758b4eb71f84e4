"""Device-to-host copy of a batch's outputs, off the GPU thread's critical path.

The GPU thread calls `start(outputs)` right after launching a batch: the copies are queued on a side
stream (after the batch's kernels), into one pinned staging buffer, so they are real DMA transfers that
overlap the NEXT batch's compute instead of a synchronous pageable `.to("cpu")` that stalls the thread.
`HostRows.wait()` runs on another thread: it waits for that copy piece by piece (an event after each 8 MiB;
the GIL is released while it waits) and copies each piece of each image's rows out of the staging buffer, while
the next pieces still cross the bus, into host memory of its own, which the cache entry then owns without
another copy (pinned memory is too scarce to hold a cache in, and torch's pinned allocator rounds blocks up to
powers of two). That memory comes from the copier's HostRowPool
(rowpath/host_pool.py): pages of rows no longer referenced, reused, rather than fresh pages that fault on
the copy. The staging buffer goes back to torch's pinned cache when the HostRows is dropped.

CPU outputs (the eager CPU runner) pass through as they are: already owned and on the host.

With a device row arena (runtime/device_arena.py, `arena`): each image's rows are also copied device to
device into a slot of it, queued on the same side stream before the host copy (the first piece's event covers
it), and once every piece is done (`wait`) each slot is bound to the image's owned host rows, for fetches by IPC.
"""

from __future__ import annotations

from typing import Sequence

import torch

from encoder_service.rowpath.host_pool import DEFAULT_MAX_IDLE_BYTES, HostRowPool
from encoder_service.runtime.device_arena import DeviceArena, Slot


# Each image's copy to the host is queued in pieces of about this many bytes, an event after each: the copy out
# of the staging buffer starts on the first piece while the next ones still cross the bus (a Qwen3 1080p image's
# rows are 66.8 MB: the two copies overlap, rather than one waiting for the other).
PIECE_BYTES = 8 << 20


class HostRows:
    """Outputs on their way to the host; `wait()` -> one owned, contiguous CPU tensor per image."""

    def __init__(self, views: list[torch.Tensor], pieces: list[list[tuple[torch.cuda.Event, int, int]]] | None,
                 pool: HostRowPool, arena: DeviceArena | None = None, slots: list[Slot | None] | None = None):
        self._views = views  # [num_tokens_i, row_width] views of the pinned staging buffer (or CPU outputs)
        self._pieces = pieces  # per view: (the event after it, its first row, its end row); None: CPU outputs
        self._pool = pool
        self._arena, self._slots = arena, slots  # each image's slot of the device row arena (None: not in it)

    def wait(self) -> list[torch.Tensor]:
        if self._pieces is None:
            rows = [v.contiguous() for v in self._views]
        else:
            rows = []
            for v, pieces in zip(self._views, self._pieces):
                owned = self._pool.take(v.numel() * v.element_size()).view(v.dtype).view(v.shape)
                for event, start, end in pieces:
                    event.synchronize()
                    owned[start:end].copy_(v[start:end])
                rows.append(owned)
        if self._arena is not None:
            self._arena.bind(self._slots, rows)  # (the arena's copies were queued before every piece)
        return rows

    def staged(self) -> list[torch.Tensor]:
        """The rows as they land, left in the pinned staging buffer (not owned, nor bound to the arena):
        what `wait` costs is measured against this (benchmarks/mlp_kernels/service.py)."""
        if self._pieces:  # (None: CPU outputs; each view has one piece at least)
            self._pieces[-1][-1][0].synchronize()  # the last piece's event: every copy on the stream is done
        return list(self._views)


class HostCopier:
    """One side stream per device for the output copies (used by the engine's GPU thread only), and the pool
    the rows land in (`pool` None: a HostRowPool keeping its idle bound's worth of mappings faulted in ahead);
    `arena`: the device row arena, if any."""

    def __init__(self, pool: HostRowPool | None = None, arena: DeviceArena | None = None):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # Until the cache is full no entry is freed, so without mappings faulted in ahead every image's rows
        # fault their pages in on the copy its answer waits for (rowpath/host_pool.py).
        self.pool = pool if pool is not None else HostRowPool(prefault_bytes=DEFAULT_MAX_IDLE_BYTES)
        self.arena = arena

    def start(self, outputs: Sequence[torch.Tensor]) -> HostRows:
        if not any(o.is_cuda for o in outputs):  # (an arena here is the CPU tests' host stand-in)
            slots = self.arena.store(outputs) if self.arena is not None else None
            return HostRows(list(outputs), None, self.pool, self.arena, slots)
        device = next(o.device for o in outputs if o.is_cuda)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # after the kernels that wrote the outputs
        nbytes = [o.numel() * o.element_size() for o in outputs]
        staging = torch.empty(sum(nbytes), dtype=torch.uint8, pin_memory=True)
        views, pieces, offset = [], [], 0
        with torch.cuda.stream(stream):
            slots = self.arena.store(outputs) if self.arena is not None else None  # device to device, first
            for o, n in zip(outputs, nbytes):
                view = staging[offset : offset + n].view(o.dtype).view(o.shape)
                pieces.append(_copy_in_pieces(view, o, stream))
                if o.is_cuda:
                    o.record_stream(stream)  # its memory is not reused before this copy has read it
                views.append(view)
                offset += n
        return HostRows(views, pieces, self.pool, self.arena, slots)


def _copy_in_pieces(view: torch.Tensor, output: torch.Tensor, stream: torch.cuda.Stream
                    ) -> list[tuple[torch.cuda.Event, int, int]]:
    """Queue `output`'s copy into `view` (its staging) on `stream` (current) in pieces of rows of about
    PIECE_BYTES, recording an event after each: [(event, first row, end row)]."""
    rows = output.shape[0]  # [num_tokens, row_width]
    step = max(1, PIECE_BYTES // max(1, output[0].numel() * output.element_size() if rows else 1))
    pieces = []
    for start in range(0, max(rows, 1), step):
        end = min(rows, start + step)
        view[start:end].copy_(output[start:end], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        pieces.append((event, start, end))
    return pieces
