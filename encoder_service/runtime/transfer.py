"""Device-to-host copy of a batch's outputs, off the GPU thread's critical path.

The GPU thread calls `start(outputs)` right after launching a batch: the copies are queued on a side
stream (after the batch's kernels), into one pinned staging buffer, so they are real DMA transfers that
overlap the NEXT batch's compute instead of a synchronous pageable `.to("cpu")` that stalls the thread.
`HostRows.wait()` runs on another thread: it waits for that copy's event (the GIL is released while it
waits) and copies each image's rows out of the staging buffer into host memory of its own, which the cache
entry then owns without another copy (pinned memory is too scarce to hold a cache in, and torch's pinned
allocator rounds blocks up to powers of two). That memory comes from the copier's HostRowPool
(runtime/host_pool.py): pages of rows no longer referenced, reused, rather than fresh pages that fault on
the copy. The staging buffer goes back to torch's pinned cache when the HostRows is dropped.

CPU outputs (the eager CPU runner) pass through as they are: already owned and on the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

from encoder_service.runtime.host_pool import HostRowPool


class HostRows:
    """Outputs on their way to the host; `wait()` -> one owned, contiguous CPU tensor per image."""

    def __init__(self, views: list[torch.Tensor], event: torch.cuda.Event | None, pool: HostRowPool):
        self._views = views  # [num_tokens_i, row_width] views of the pinned staging buffer (or CPU outputs)
        self._event = event
        self._pool = pool

    def wait(self) -> list[torch.Tensor]:
        if self._event is None:
            return [v.contiguous() for v in self._views]
        self._event.synchronize()
        rows = []
        for v in self._views:
            owned = self._pool.take(v.numel() * v.element_size()).view(v.dtype).view(v.shape)
            rows.append(owned.copy_(v))
        return rows


class HostCopier:
    """One side stream per device for the output copies (used by the engine's GPU thread only), and the pool
    the rows land in (`pool` None: a HostRowPool with its defaults)."""

    def __init__(self, pool: HostRowPool | None = None):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.pool = pool if pool is not None else HostRowPool()

    def start(self, outputs: Sequence[torch.Tensor]) -> HostRows:
        if not any(o.is_cuda for o in outputs):
            return HostRows(list(outputs), None, self.pool)
        device = next(o.device for o in outputs if o.is_cuda)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # after the kernels that wrote the outputs
        nbytes = [o.numel() * o.element_size() for o in outputs]
        staging = torch.empty(sum(nbytes), dtype=torch.uint8, pin_memory=True)
        views, offset = [], 0
        with torch.cuda.stream(stream):
            for o, n in zip(outputs, nbytes):
                view = staging[offset : offset + n].view(o.dtype).view(o.shape)
                view.copy_(o, non_blocking=True)
                if o.is_cuda:
                    o.record_stream(stream)  # its memory is not reused before this copy has read it
                views.append(view)
                offset += n
            event = torch.cuda.Event()
            event.record(stream)
        return HostRows(views, event, self.pool)
