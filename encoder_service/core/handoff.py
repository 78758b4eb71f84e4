"""The core's side of the handoff of ids between replicas that share one Redis (cache/handoff.py has the
mechanism: pending markers, pub/sub outcomes).

Behind one Service, an LLM server's `encode` and its `fetch` of the same id may reach different replicas.

  encode (replica A)  `recorded_tags(caller ids)`: before admitting caller ids it neither has nor is encoding,
                      the content tags other replicas recorded for them (rows in Redis, or an encode under
                      way), so that an id sent with other bytes than it names is a Conflict on every replica.
                      `mark(misses, hits, tags)`: the ids it admitted to its engine (its misses) are marked pending
                      in Redis before it answers, so that a fetch anywhere waits for them. A marker that
                      cannot be written (Redis down or full, an error) does not fail the encode: the id is
                      served here as before, and a fetch elsewhere answers at once as it did without markers.
                      Counted (`encoder_pending_unmarked_total`), logged once per run of failures. Its local
                      hits are shared (`store.share`): Redis evicts by its own LRU, which never sees a hit
                      served here, so an id used here all the time may be gone there; such ids are marked
                      pending and written again.
  fetch (replica B)   `header_from_elsewhere(key, deadline)`: for an id no tier here knows (not in flight, not
                      in the local tier, no entry in Redis), wait within what is left of the fetch's timeout
                      until the rows land in Redis, then read their header. Outcomes as errors: the encode
                      failed -> that replica's error kind (a decode error stays 400; rows that could not be
                      stored -> 404 saying why); nobody accepted it -> 404; timeout -> 504; Redis unreachable
                      -> 503 at once (the id may exist elsewhere: this replica cannot tell now).

Without Redis there is nothing to wait on: a fetch must reach the replica that encoded the id (the chart's
`service.sessionAffinity: ClientIP` does that for one client pod; deploy/README.md, "Scaling out").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from encoder_service import errors
from encoder_service.cache import CacheKey, EmbeddingStore, EntryHeader, Settled
from encoder_service.core.metrics import Metrics
from encoder_service.core.timeouts import Deadline

log = logging.getLogger(__name__)


class Handoff:
    def __init__(self, store: EmbeddingStore, metrics: Metrics):
        self.store = store
        self.metrics = metrics
        self._failing = False  # the last marking failed: log again only after one succeeds

    @property
    def enabled(self) -> bool:
        return self.store.redis is not None

    # ---- encode ----------------------------------------------------------------------------------------
    async def recorded_tags(self, keys: Sequence[CacheKey]) -> dict[str, int]:
        """By name, the content tags other replicas recorded for these caller ids; {} without Redis, or when
        Redis cannot tell (down: the encode goes on, as it does without Redis)."""
        if not self.enabled or not keys:
            return {}
        return await self.store.content_tags(keys)

    def mark(self, misses: Sequence[CacheKey], hits: Sequence[CacheKey],
             tags: Mapping[str, int] | None = None) -> asyncio.Task | None:
        """Start marking `misses` pending (each marker with its content tag from `tags`, by name: a caller id's
        bytes) and sharing the local `hits` (one Redis round trip each, together); None without Redis or ids.
        The task never raises. The encode awaits it before answering, and each miss's fill awaits it before it
        encodes: a marker must be set before the outcome that settles it can be published."""
        if not self.enabled or not (misses or hits):
            return None
        return asyncio.create_task(self._mark(list(misses), list(hits), tags), name="mark pending")

    async def _mark(self, misses: list[CacheKey], hits: list[CacheKey], tags: Mapping[str, int] | None) -> None:
        await asyncio.gather(self._pending(misses, tags), self._share(hits))

    async def _share(self, hits: list[CacheKey]) -> None:
        try:
            await self.store.share(hits)
        except Exception:  # never fatal to the encode (a fetch elsewhere of an evicted id answers 404)
            # The tier answers Redis faults itself (counted, logged once): what reaches here is a bug.
            log.warning("sharing %d local hits failed", len(hits), exc_info=True)

    async def _pending(self, keys: list[CacheKey], tags: Mapping[str, int] | None) -> None:
        if not keys:
            return
        try:
            marked = await self.store.mark_pending(keys, tags=tags)
        except Exception:  # never fatal to the encode; Redis faults the tier answers itself: this is a bug
            log.warning("marking %d ids pending failed", len(keys), exc_info=True)
            marked = False
        if marked:
            self._failing = False
            return
        self.metrics.pending_unmarked.inc(len(keys))
        if not self._failing:
            self._failing = True
            log.warning("ids accepted here could not be marked pending in Redis (down, full or busy): until "
                        "that works again, fetches of them on other replicas answer at once instead of waiting")

    # ---- fetch -----------------------------------------------------------------------------------------
    async def header_from_elsewhere(self, key: CacheKey, deadline: Deadline) -> EntryHeader:
        """The header of `key`, which no tier here has: once the encode another replica accepted lands in
        Redis, within `deadline`. Raises the error the fetch answers otherwise."""
        if not self.enabled:
            raise errors.NotFound(f"unknown id {key.id!r}: never encoded here, or evicted (encode it again; "
                                  "without Redis a fetch must reach the replica that encoded the id)")
        settled = await self.store.wait_for(key, deadline.left())  # raises EncodeFailed: A's error, A's kind
        if settled is Settled.LANDED:
            header = await self.store.header(key)
            if header is not None:
                return header
            raise errors.NotFound(f"id {key.id!r} was encoded on another replica, but its rows left Redis before "
                                  "they could be read (evicted: encode it again)")
        if settled is Settled.NOT_PENDING:
            raise errors.NotFound(f"unknown id {key.id!r}: not encoded here nor being encoded by another replica, "
                                  "or evicted (encode it again)")
        if settled is Settled.TIMED_OUT:
            if deadline.dont_wait:
                raise errors.DeadlineExceeded(f"timeout_s=0 (don't wait) and id {key.id!r} is still encoding on "
                                              "another replica")
            raise errors.DeadlineExceeded(f"id {key.id!r} is encoding on another replica and its rows did not "
                                          f"land within timeout_s={deadline.timeout_s}")
        raise errors.Unavailable(f"id {key.id!r} is not on this replica, and the shared Redis tier, where other "
                                 "replicas' rows are, is unreachable: retry, or encode it again")
