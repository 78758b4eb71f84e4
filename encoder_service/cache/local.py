"""In-process LRU tier bounded in bytes, with leases (pins) bounded separately.

Pinned entries live outside the LRU order, so eviction never scans past them and LRU pressure cannot
evict an id in the middle of a chunked prefill. A pin is a lease: a count and a deadline per key.
  - `pin` adds one holder and extends the deadline to the later of the two (two requests that encode
    the same image each hold it; one releasing does not unpin the other's).
  - `release` drops one holder; at zero the entry goes back to the LRU (most recently used end).
  - at the deadline the pin goes whatever the count (a client that never releases cannot leak pins).
A key can be pinned before its entry exists (the core answers `encode` before the ViT runs): the pin
then reserves `nbytes`, the expected size, and the entry takes the reserved place when it arrives.
Pinned bytes are bounded by `max_pinned_bytes`; a pin over the bound raises `Overloaded` (HTTP 429)
rather than evicting something silently. Leases expire lazily: every operation first pops the due
deadlines off a heap (O(log n) each), so no timer task or polling loop is needed.
Not thread-safe: used from the event loop only.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from encoder_service.cache.entry import Entry
from encoder_service.errors import Overloaded


@dataclass
class _Pin:
    holders: int
    deadline: float
    nbytes: int  # bytes counted against max_pinned_bytes: the entry's, or the reservation


class LocalTier:
    def __init__(
        self,
        capacity_bytes: int,
        max_pinned_bytes: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 <= max_pinned_bytes <= capacity_bytes:
            raise ValueError(
                f"max_pinned_bytes is {max_pinned_bytes}, must be between 0 and the capacity {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self.max_pinned_bytes = max_pinned_bytes
        self._clock = clock
        self._lru: OrderedDict[str, Entry] = OrderedDict()  # unpinned, oldest first
        self._pinned: dict[str, Entry] = {}  # pinned and present
        self._pins: dict[str, _Pin] = {}  # pinned keys, present or reserved
        self._deadlines: list[tuple[float, str]] = []  # heap; stale items skipped on pop
        self.used_bytes = 0  # entries held, pinned or not
        self.pinned_bytes = 0
        self.counters = dict(hits=0, misses=0, inserts=0, evictions=0, too_big=0, lease_expired=0, pin_refused=0)

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def __contains__(self, key: str) -> bool:
        return key in self._lru or key in self._pinned

    def get(self, key: str) -> Entry | None:
        self._expire_leases()
        entry = self._pinned.get(key)
        if entry is None:
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
        self.counters["hits" if entry is not None else "misses"] += 1
        return entry

    def peek(self, key: str) -> Entry | None:
        """The entry if present, without counting a hit/miss or moving it in the LRU order."""
        return self._pinned.get(key) or self._lru.get(key)

    def put(self, key: str, entry: Entry) -> bool:
        """Insert or replace; False when an unpinned entry cannot fit even in an empty LRU."""
        self._expire_leases()
        self._drop(key)
        pin = self._pins.get(key)
        if pin is not None:
            # Reserved at encode time with the expected size; the real size replaces it.
            self.pinned_bytes += entry.nbytes - pin.nbytes
            pin.nbytes = entry.nbytes
            self._pinned[key] = entry
        else:
            self._evict_until_fits(entry.nbytes)
            if self.used_bytes + entry.nbytes > self.capacity_bytes:
                self.counters["too_big"] += 1
                return False
            self._lru[key] = entry
        self.used_bytes += entry.nbytes
        self.counters["inserts"] += 1
        if pin is not None:
            self._evict_until_fits(0)
        return True

    def pin(self, key: str, lease_s: float, nbytes: int | None = None) -> None:
        """Hold `key` for `lease_s` seconds (one more holder). `nbytes` reserves room for an entry not
        yet present. Raises Overloaded when the pinned bytes would pass `max_pinned_bytes`."""
        self._expire_leases()
        deadline = self._clock() + lease_s
        pin = self._pins.get(key)
        if pin is not None:
            pin.holders += 1
            if deadline > pin.deadline:
                pin.deadline = deadline
                heapq.heappush(self._deadlines, (deadline, key))
            return
        entry = self.peek(key)
        if entry is not None:
            nbytes = entry.nbytes
        elif nbytes is None:
            raise ValueError(f"{key} is not in the local tier: pass nbytes to reserve room for it")
        if self.pinned_bytes + nbytes > self.max_pinned_bytes:
            self.counters["pin_refused"] += 1
            raise Overloaded(
                f"pinned embeddings would take {self.pinned_bytes + nbytes} bytes, over the limit of "
                f"{self.max_pinned_bytes} (--max-pinned-bytes): fetch or release earlier ids, or retry later"
            )
        self._pins[key] = _Pin(1, deadline, nbytes)
        self.pinned_bytes += nbytes
        heapq.heappush(self._deadlines, (deadline, key))
        if entry is not None and key in self._lru:
            self._pinned[key] = self._lru.pop(key)

    def release(self, key: str) -> bool:
        """Drop one holder of `key`'s pin; False if it was not pinned (released or expired already)."""
        self._expire_leases()
        pin = self._pins.get(key)
        if pin is None:
            return False
        pin.holders -= 1
        if pin.holders <= 0:
            self._unpin(key)
        return True

    def pinned_keys(self) -> list[str]:
        """The keys whose entry is here and pinned (leased)."""
        self._expire_leases()
        return list(self._pinned)

    def is_pinned(self, key: str) -> bool:
        self._expire_leases()
        return key in self._pins

    def stats(self) -> dict:
        self._expire_leases()
        return dict(
            self.counters,
            entries=len(self),
            used_bytes=self.used_bytes,
            capacity_bytes=self.capacity_bytes,
            pinned_keys=len(self._pins),
            pinned_bytes=self.pinned_bytes,
            max_pinned_bytes=self.max_pinned_bytes,
        )

    def _unpin(self, key: str) -> None:
        pin = self._pins.pop(key)
        self.pinned_bytes -= pin.nbytes
        entry = self._pinned.pop(key, None)
        if entry is not None:
            self._lru[key] = entry  # most recently used: it was just being read
            self._evict_until_fits(0)

    def _expire_leases(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, key = heapq.heappop(self._deadlines)
            pin = self._pins.get(key)
            if pin is not None and pin.deadline == deadline:  # else extended or released: stale item
                self.counters["lease_expired"] += 1
                self._unpin(key)

    def _evict_until_fits(self, incoming: int) -> None:
        while self._lru and self.used_bytes + incoming > self.capacity_bytes:
            _, old = self._lru.popitem(last=False)
            self.used_bytes -= old.nbytes
            self.counters["evictions"] += 1

    def _drop(self, key: str) -> None:
        old = self._lru.pop(key, None) or self._pinned.pop(key, None)
        if old is not None:
            self.used_bytes -= old.nbytes
