"""Device-to-host copy of a batch's outputs, off the GPU thread's critical path.

The GPU thread calls `start(outputs)` right after launching a batch: the copies are queued on a side
stream (after the batch's kernels), into one pinned staging buffer, so they are real DMA transfers that
overlap the NEXT batch's compute instead of a synchronous pageable `.to("cpu")` that stalls the thread.
`HostRows.wait()` runs on another thread: it waits for that copy's event (the GIL is released while it
waits) and copies each image's rows out of the staging buffer into host memory of its own, which the cache
entry then owns without another copy (pinned memory is too scarce to hold a cache in, and torch's pinned
allocator rounds blocks up to powers of two). That memory comes from the copier's HostRowPool
(rowpath/host_pool.py): pages of rows no longer referenced, reused, rather than fresh pages that fault on
the copy. The staging buffer goes back to torch's pinned cache when the HostRows is dropped.

CPU outputs (the eager CPU runner) pass through as they are: already owned and on the host.

With a device row arena (runtime/device_arena.py, `arena`): each image's rows are also copied device to
device into a slot of it, queued on the same side stream before the host copy (the event covers both), and
once the event is done (`wait`) each slot is bound to the image's owned host rows, for fetches by IPC.
"""

from __future__ import annotations

from typing import Sequence

import torch

from encoder_service.rowpath.host_pool import DEFAULT_MAX_IDLE_BYTES, HostRowPool
from encoder_service.runtime.device_arena import DeviceArena, Slot


class HostRows:
    """Outputs on their way to the host; `wait()` -> one owned, contiguous CPU tensor per image."""

    def __init__(self, views: list[torch.Tensor], event: torch.cuda.Event | None, pool: HostRowPool,
                 arena: DeviceArena | None = None, slots: list[Slot | None] | None = None):
        self._views = views  # [num_tokens_i, row_width] views of the pinned staging buffer (or CPU outputs)
        self._event = event
        self._pool = pool
        self._arena, self._slots = arena, slots  # each image's slot of the device row arena (None: not in it)

    def wait(self) -> list[torch.Tensor]:
        if self._event is None:
            rows = [v.contiguous() for v in self._views]
        else:
            self._event.synchronize()
            rows = []
            for v in self._views:
                owned = self._pool.take(v.numel() * v.element_size()).view(v.dtype).view(v.shape)
                rows.append(owned.copy_(v))
        if self._arena is not None:
            self._arena.bind(self._slots, rows)
        return rows


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
        views, offset = [], 0
        with torch.cuda.stream(stream):
            slots = self.arena.store(outputs) if self.arena is not None else None  # device to device, first
            for o, n in zip(outputs, nbytes):
                view = staging[offset : offset + n].view(o.dtype).view(o.shape)
                view.copy_(o, non_blocking=True)
                if o.is_cuda:
                    o.record_stream(stream)  # its memory is not reused before this copy has read it
                views.append(view)
                offset += n
            event = torch.cuda.Event()
            event.record(stream)
        return HostRows(views, event, self.pool, self.arena, slots)
