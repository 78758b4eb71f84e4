"""In-process LRU tier bounded in bytes, with leases (pins) bounded separately.

Pinned entries live outside the LRU order, so eviction never scans past them and LRU pressure cannot
evict an id in the middle of a chunked prefill. A pin is a lease: a count and a deadline per key.
  - `pin` adds one holder and extends the deadline to the later of the two (two requests that encode
    the same image each hold it; one releasing does not unpin the other's).
  - `delivered` counts the rows one fetch delivered, per row, since the pin began: once every row of the
    key has been delivered k more times, k holders end (their readers have every row: a client that
    fetches all rows and never releases holds its pin only until then). Such a holder is remembered
    (`_Ended`, until its lease would have ended) so that its client's own later `release` drops that
    record, not the pin of another request for the same image, and so that the id stays leased for the
    store (`leased_keys`: written to Redis again after an outage, as the pinned ones are).
  - `release` (a client's) drops one holder, one a full fetch ended first, else a live one; `unpin` (an
    encode taking back the pin it just made: its request failed or left) a live one. At zero the entry goes
    back to the LRU (most recently used end).
  - at the deadline the pin goes whatever the count (a client that never releases cannot leak pins).
Fetches and releases carry no holder's name, so two guesses err each on its own side:
  - a re-fetch of every row by one reader (or a prompt with the image twice) counts as another reader's, and
    may end a second request's pin early; its rows then stay in the LRU, most recently used, as a released
    id's do;
  - a release that no full fetch of its client came before (a request that gave up) while such a record of
    another client's exists drops that record: the live pin then lasts until a full fetch or its lease.
A key can be pinned before its entry exists (the core answers `encode` before the ViT runs): the pin
then reserves `nbytes`, the expected size, and the entry takes the reserved place when it arrives.
Pinned bytes are bounded by `max_pinned_bytes`; a pin over the bound raises `Overloaded` (HTTP 429)
rather than evicting something silently. Leases expire lazily: every operation first pops the due
deadlines off a heap (O(log n) each), so no timer task or polling loop is needed.
Not thread-safe: used from the event loop only.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from encoder_service.cache.entry import Entry
from encoder_service.errors import Overloaded


# Holders ended by full fetches, remembered for their clients' releases: at most this many keys (the oldest
# forgotten first: a release of one of those then drops a live holder, as before fetches ended any).
ENDED_KEPT = 1 << 16


class _RowCounts:
    """How many times each row of [0, num_rows) was delivered: a step function, step i covering rows
    [starts[i], starts[i + 1]) (the last one up to num_rows) with counts[i]. At most one step per distinct
    range end delivered, so at most num_rows steps."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.starts, self.counts = [0], [0]

    def add(self, start: int, end: int) -> None:
        """One more delivery of rows [start, end) (0 <= start < end <= num_rows)."""
        first = self._split(start)
        last = self._split(end) if end < self.num_rows else len(self.starts)
        for i in range(first, last):
            self.counts[i] += 1

    def take_full(self) -> int:
        """How many times every row has been delivered; those deliveries are taken off the counts."""
        full = min(self.counts)
        if full:
            starts, counts = [], []
            for start, count in zip(self.starts, self.counts):
                if not counts or counts[-1] != count - full:  # steps left equal merge
                    starts.append(start)
                    counts.append(count - full)
            self.starts, self.counts = starts, counts
        return full

    def _split(self, row: int) -> int:
        """The index of the step that starts at `row` (0 <= row < num_rows), made by splitting the one
        holding it if there is none."""
        i = bisect.bisect_right(self.starts, row) - 1
        if self.starts[i] != row:
            i += 1
            self.starts.insert(i, row)
            self.counts.insert(i, self.counts[i - 1])
        return i


@dataclass
class _Pin:
    holders: int
    deadline: float
    nbytes: int  # bytes counted against max_pinned_bytes: the entry's, or the reservation
    rows: _RowCounts | None = None  # rows fetches delivered since the pin began (None: none yet)


@dataclass
class _Ended:
    """Holders of a key that full fetches ended: the next `count` releases of the key are theirs."""

    count: int
    deadline: float  # the lease they had: a release after it finds nothing, as after a lease's end


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
        self._ended: OrderedDict[str, _Ended] = OrderedDict()  # oldest first, at most ENDED_KEPT
        self._deadlines: list[tuple[float, str]] = []  # heap; stale items skipped on pop
        self.used_bytes = 0  # entries held, pinned or not
        self.pinned_bytes = 0
        self.counters = dict(hits=0, misses=0, inserts=0, evictions=0, too_big=0, lease_expired=0, pin_refused=0,
                             fetch_ended=0)

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
                f"pins are full: {self.pinned_bytes} bytes of embeddings are pinned ({len(self._pins)} ids), and "
                f"{nbytes} more would pass --max-pinned-bytes ({self.max_pinned_bytes}). An id stays pinned from "
                "its encode until a fetch has delivered every one of its rows, its release (client.release, "
                "POST /v1/release, Encoder.Release), or its lease's end (--lease-s): fetch all rows of the ids "
                "you encoded, release those you will not fetch, or raise --max-pinned-bytes (with --cache-bytes)"
            )
        self._pins[key] = _Pin(1, deadline, nbytes)
        self.pinned_bytes += nbytes
        heapq.heappush(self._deadlines, (deadline, key))
        if entry is not None and key in self._lru:
            self._pinned[key] = self._lru.pop(key)

    def delivered(self, key: str, num_rows: int, ranges: Iterable[tuple[int, int]]) -> int:
        """One fetch delivered `ranges` ([start, end) pairs, overlapping or not: each row counts once) of the
        `num_rows` rows of `key`. Each time every row has been delivered once more since the pin began, one
        holder ends (remembered for its release). Returns how many ended; 0 when `key` is not pinned here."""
        self._expire_leases()
        pin = self._pins.get(key)
        if pin is None:
            return 0
        if pin.rows is None or pin.rows.num_rows != num_rows:
            pin.rows = _RowCounts(num_rows)
        for start, end in _merged((max(0, start), min(end, num_rows)) for start, end in ranges):
            pin.rows.add(start, end)
        ended = min(pin.rows.take_full(), pin.holders)
        if ended:
            self.counters["fetch_ended"] += ended
            record = self._ended.pop(key, None) or _Ended(0, pin.deadline)
            record.count += ended
            record.deadline = max(record.deadline, pin.deadline)  # a deadline of the pin's: in the heap
            self._ended[key] = record  # most recent last
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            pin.holders -= ended
            if not pin.holders:
                self._end_pin(key)
        return ended

    def release(self, key: str) -> bool:
        """Drop one holder of `key`: first one a full fetch ended (most likely this client's own: a release
        after its fetch), else one of its pin. False if it had none (released, expired, never pinned)."""
        self._expire_leases()
        record = self._ended.get(key)
        if record is not None:
            record.count -= 1
            if not record.count:
                del self._ended[key]
            return True
        return self.unpin(key)

    def unpin(self, key: str) -> bool:
        """Drop one live holder of `key`'s pin (an encode giving back the pin it took); False if not pinned."""
        self._expire_leases()
        pin = self._pins.get(key)
        if pin is None:
            return False
        pin.holders -= 1
        if pin.holders <= 0:
            self._end_pin(key)
        return True

    def names(self) -> list[str]:
        """Every key with an entry here."""
        return [*self._pinned, *self._lru]

    def discard(self, key: str) -> None:
        """Drop `key`'s entry and pin, whoever holds it (its content is not what the id names any more)."""
        if key in self._pins:
            self._end_pin(key)
        self._ended.pop(key, None)
        self._drop(key)

    def leased_keys(self) -> list[str]:
        """The keys whose entry is here and whose lease has not ended: pinned, or pinned until a full fetch
        ended the pin (remembered until its lease's end, `_Ended`)."""
        self._expire_leases()
        return list(self._pinned) + [key for key in self._ended if key not in self._pinned and key in self._lru]

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
            ended_keys=len(self._ended),
            pinned_bytes=self.pinned_bytes,
            max_pinned_bytes=self.max_pinned_bytes,
        )

    def _end_pin(self, key: str) -> None:
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
                self._end_pin(key)
            record = self._ended.get(key)
            if record is not None and record.deadline == deadline:
                del self._ended[key]

    def _evict_until_fits(self, incoming: int) -> None:
        while self._lru and self.used_bytes + incoming > self.capacity_bytes:
            _, old = self._lru.popitem(last=False)
            self.used_bytes -= old.nbytes
            self.counters["evictions"] += 1

    def _drop(self, key: str) -> None:
        old = self._lru.pop(key, None) or self._pinned.pop(key, None)
        if old is not None:
            self.used_bytes -= old.nbytes


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-empty, with overlapping or touching ranges joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[0] < r[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
