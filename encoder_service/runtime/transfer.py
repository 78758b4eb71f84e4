"""Device-to-host copy of a batch's outputs, off the GPU thread's critical path.

The GPU thread calls `start(outputs)` right after launching a batch: the copies are queued on a side
stream (after the batch's kernels), into one pinned staging buffer, so they are real DMA transfers that
overlap the NEXT batch's compute instead of a synchronous pageable `.to("cpu")` that stalls the thread.
`HostRows.wait()` runs on another thread: it waits for that copy's event (the GIL is released while it
waits) and copies each image's rows out of the staging buffer into its own pageable tensor, which the
cache entry then owns without another copy (pinned memory is too scarce to hold a cache in, and torch's
pinned allocator rounds blocks up to powers of two). The staging buffer goes back to torch's pinned cache
when the HostRows is dropped.

CPU outputs (the eager CPU runner) pass through as they are: already owned and on the host.
"""

from __future__ import annotations

from typing import Sequence

import torch


class HostRows:
    """Outputs on their way to the host; `wait()` -> one owned, contiguous CPU tensor per image."""

    def __init__(self, views: list[torch.Tensor], event: torch.cuda.Event | None):
        self._views = views  # [num_tokens_i, row_width] views of the pinned staging buffer (or CPU outputs)
        self._event = event

    def wait(self) -> list[torch.Tensor]:
        if self._event is None:
            return [v.contiguous() for v in self._views]
        self._event.synchronize()
        return [v.clone() for v in self._views]


class HostCopier:
    """One side stream per device for the output copies (used by the engine's GPU thread only)."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def start(self, outputs: Sequence[torch.Tensor]) -> HostRows:
        if not any(o.is_cuda for o in outputs):
            return HostRows(list(outputs), None)
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
        return HostRows(views, event)
