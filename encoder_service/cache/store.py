"""EmbeddingStore: what this process holds (the host LRU tier with its leases, local.py), by key. It calls
nothing back and knows no other replica: what replicas share goes through the face the core holds
(replicas/: `Solo` reads and writes this store alone, `Shared` this store, then Redis).

    store = EmbeddingStore(local_bytes, lease_s=300, max_pinned_bytes=local_bytes // 2)
    store.get(key)                    -> Entry | None       a lookup (counted, moves it in the LRU)
    store.peek(key)                   -> Entry | None       no accounting, no LRU move
    store.rows(key, start, end)       -> Tensor | None      rows of the entry (a read-only view, a lookup)
    store.put(key, entry)
    store.pin(key, lease_s=None, nbytes=None)     raises Overloaded;    store.unpin(key) -> bool (an encode's own)
    store.delivered(key, num_rows, ranges) -> int  a fetch's rows: full deliveries end holders
    store.release(key) -> bool                     a client's release
    store.stats()                                  -> dict (`local_*` counters)

`key` is a `CacheKey` (keys.py) or its full name.

Leases, the flow the core follows (core/encoder.py):
  1. `encode`: `store.pin(key, nbytes=expected)` BEFORE answering (raises Overloaded -> 429 when pins are
     full), then the id's flight fills it in the background. The pin reserves the bytes until the entry lands.
  2. `fetch` chunks: rows read (an id still in flight is read from its flight), then `delivered` with the
     rows the fetch sent: a chunked prefill reads an image over several chunks, and once every row has been
     delivered (since the pin began) one holder ends, so a client that fetches all rows and never releases
     holds its pin only that long. A fetch another replica makes for its client (replicas/peers.py) counts
     here as the client's; a replica copying the rows for itself ends nothing.
  3. Else the pin ends at `release(key)` (the client's "done" for that id, optional) or when the lease
     expires, whichever comes first. Pins are counted per holder: two requests encoding the same image each
     hold one. An encode that fails or is left before its answer gives its own pin back (`unpin`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from encoder_service.cache.entry import Entry
from encoder_service.cache.keys import CacheKey
from encoder_service.cache.local import LocalTier

Key = CacheKey | str


def _name(key: Key) -> str:
    return key.name if isinstance(key, CacheKey) else key


class EmbeddingStore:
    def __init__(self, local_bytes: int, *, lease_s: float = 300, max_pinned_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.lease_s = lease_s
        self.local = LocalTier(
            local_bytes, local_bytes // 2 if max_pinned_bytes is None else max_pinned_bytes, clock=clock
        )

    def get(self, key: Key) -> Entry | None:
        return self.local.get(_name(key))

    def peek(self, key: Key) -> Entry | None:
        """The entry, or None; no hit/miss counted, no LRU promotion."""
        return self.local.peek(_name(key))

    def rows(self, key: Key, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) of the entry (a read-only view, a lookup), or None. InvalidInput when the range
        is outside the entry."""
        entry = self.local.get(_name(key))
        return entry.rows(start, end) if entry is not None else None

    def put(self, key: Key, entry: Entry) -> None:
        self.local.put(_name(key), entry)

    # ---- leases ---------------------------------------------------------------------------------

    def pin(self, key: Key, lease_s: float | None = None, nbytes: int | None = None) -> None:
        """Keep `key` for `lease_s` (default: the store's) or until `release`. `nbytes` reserves room when the
        entry is not there yet. Raises Overloaded when pins are full."""
        self.local.pin(_name(key), self.lease_s if lease_s is None else lease_s, nbytes)

    def unpin(self, key: Key) -> bool:
        """Give back a pin an encode just took (its request failed or its caller left)."""
        return self.local.unpin(_name(key))

    def delivered(self, key: Key, num_rows: int, ranges: Iterable[tuple[int, int]]) -> int:
        """A fetch delivered rows `ranges` of `key` (of `num_rows`): holders whose every row is delivered end
        (local.py). Returns how many ended."""
        return self.local.delivered(_name(key), num_rows, ranges)

    def release(self, key: Key) -> bool:
        """A client is done with `key`: one holder of it ends (one a full fetch ended already, first)."""
        return self.local.release(_name(key))

    def stats(self) -> dict:
        """The local tier's counters, each as `local_<name>`."""
        return {f"local_{name}": value for name, value in self.local.stats().items()}
