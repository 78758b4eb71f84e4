"""Packs queued images into ViT batches by patch-token budget.

Images are kept in arrival order of their requests and placeholder order within a request (urgent ones, that a
fetch waits for, go to the front, in their own order); a batch is the images whose prepare has ended, in queue
order, while their patches fit the budget (an image larger than the budget goes alone). An image still being
prepared stays queued in its place and holds no other requester's images back (but an urgent one, which is
prepared first); its own requester's later images wait for it, so each requester's images reach the GPU in
their order. The budget is `batch_tokens`,
capped at the largest graph bucket when graphs are in use so that a batch fills a captured bucket instead of
falling back to eager. Items nobody wants any more (`wanted()` is false: their callers all left), or whose
deadline passed, are dropped (their futures settled) before a batch is built.
Pure and loop-bound: no threads here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

from encoder_service.errors import DeadlineExceeded
from encoder_service.models.metadata import GridTHW


def always_wanted() -> bool:
    return True


@dataclass(eq=False)
class WorkItem:
    """One image waiting for the ViT: its pixel values have the grid `grid_thw` (t*h*w patches).

    `prepared` resolves to (pixel_values [num_patches, patch_dim], preprocess ms) from the engine's `prepare`
    on a CPU thread; `future` resolves to the engine's `EncodedImage`. `wanted()` is asked before
    each batch is built (the core's answer: does a request or a fetch still wait for this image?). Times are
    `time.monotonic()` seconds.
    """

    grid_thw: GridTHW
    prepared: asyncio.Future
    future: asyncio.Future
    deadline: float | None = None
    wanted: Callable[[], bool] = always_wanted
    warmup: bool = False  # the readiness encode: not counted in the metrics
    urgent: bool = False  # pushed to the front of the queue
    # Who asked (engine.py: Job.requester; by default the item itself): its images are batched in their order.
    requester: Hashable = field(default_factory=object)
    reserved: bool = False  # submitted under an engine Reservation (counted by it, not by the queue)
    enqueued_at: float = field(default_factory=time.monotonic)
    seq: int = 0  # request arrival number (set by the scheduler)
    index: int = 0  # placeholder order inside the request

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def droppable(self, now: float) -> bool:
        return self.future.done() or not self.wanted() or self.expired(now)


def drop(item: WorkItem, now: float) -> None:
    """Settle a dropped item's futures: expired -> DeadlineExceeded, abandoned -> cancelled."""
    if not item.future.done():
        if item.expired(now):
            waited = now - item.enqueued_at
            item.future.set_exception(DeadlineExceeded(f"image waited {waited:.3f}s in the queue, past its deadline"))
        else:
            item.future.cancel()
    if not item.prepared.done():
        item.prepared.cancel()


def batch_budget(batch_tokens: int, buckets: Sequence[int] = ()) -> int:
    """Patch budget of one batch: batch_tokens, capped at the largest graph bucket if there are buckets."""
    return min(batch_tokens, max(buckets)) if buckets else batch_tokens


class Scheduler:
    def __init__(self, budget: int):
        if budget <= 0:
            raise ValueError(f"batch budget must be > 0, got {budget}")
        self.budget = budget
        self._queue: deque[WorkItem] = deque()
        self._seq = 0
        self._patches = 0
        self._reserved = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def queued_patches(self) -> int:
        return self._patches

    @property
    def reserved(self) -> int:
        """Queued items submitted under a reservation."""
        return self._reserved

    def push(self, items: Iterable[WorkItem]) -> None:
        """Append one request's images (in placeholder order); urgent ones go to the front, in order."""
        self._seq += 1
        items = list(items)
        for index, item in enumerate(items):
            item.seq, item.index = self._seq, index
            self._patches += item.num_patches
            self._reserved += item.reserved
        self._queue.extend(item for item in items if not item.urgent)
        self._queue.extendleft(reversed([item for item in items if item.urgent]))

    def next_batch(self, now: float | None = None) -> list[WorkItem]:
        """Drop dead items, then take the prepared ones in queue order until one does not fit the budget (the
        first whatever its size); empty when none is prepared."""
        now = time.monotonic() if now is None else now
        self._drop_dead(now)
        batch: list[WorkItem] = []
        total = 0
        behind: set = set()  # requesters with an image not prepared yet: their later ones wait behind it
        for item in self._queue:  # those not prepared yet are passed over: they keep their places
            if item.requester in behind or not item.prepared.done():
                if item.urgent:  # nothing passes an urgent one (a fetch waits for it; it is prepared first)
                    break
                behind.add(item.requester)
                continue
            if batch and total + item.num_patches > self.budget:
                break
            batch.append(item)
            total += item.num_patches
        if batch:
            taken = set(batch)
            self._queue = deque(item for item in self._queue if item not in taken)
        self._patches -= total
        self._reserved -= sum(item.reserved for item in batch)
        return batch

    def discard(self, item: WorkItem) -> bool:
        """Take `item` out of the queue (its caller gave it up); False if it is not queued (batched already)."""
        try:
            self._queue.remove(item)
        except ValueError:
            return False
        self._patches -= item.num_patches
        return True

    def drain(self) -> list[WorkItem]:
        items = list(self._queue)
        self._queue.clear()
        self._patches = 0
        self._reserved = 0
        return items

    def _drop_dead(self, now: float) -> None:
        if not any(it.droppable(now) for it in self._queue):
            return
        alive: deque[WorkItem] = deque()
        for item in self._queue:
            if item.droppable(now):
                drop(item, now)
                self._patches -= item.num_patches
                self._reserved -= item.reserved
            else:
                alive.append(item)
        self._queue = alive
