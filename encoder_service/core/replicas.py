"""The core's side of the handoff of ids between replicas that share one Redis (cache/directory.py has the
mechanism: claims with a heartbeat, the image bytes beside them, pub/sub outcomes).

Behind one Service, an LLM server's `encode` and its `fetch` of the same id may reach different replicas,
two replicas may be asked for the same new image at once, and a replica may die mid-encode.

  encode (replica A)  `bind_tags(caller ids)`: before admitting anything, each caller id of the request is
                      bound in Redis to the content tag of its bytes, first come first served (SET NX): an id
                      another replica bound to other bytes is a Conflict here, whatever raced, so an id names
                      one content on every replica (and the loser admits, claims and keeps nothing).
                      `mark(misses, hits)`: the images it admitted to its engine (its misses) are claimed in
                      Redis before it answers, with their bytes, so that a fetch anywhere waits for them and
                      can encode them itself should A die; one that another replica claimed first is not
                      encoded here too (its flight waits for that replica's rows: core/flight.py). A claim
                      that cannot be written (Redis down or full, an error) does not fail the encode: the id
                      is served here as before, its marker written once Redis takes it again, and until
                      then a fetch elsewhere answers at once. Counted (`encoder_pending_unmarked_total`),
                      logged once per run of failures. Its local hits are shared (`store.share`): Redis
                      evicts by its own LRU, which never sees a hit served here, so an id used here all the
                      time may be gone there; such ids are marked pending and written again.
  fetch (replica B)   `num_tokens_elsewhere(key, deadline)`: for an id no tier here knows (not in flight, not
                      in the local tier, no entry in Redis), wait within what is left of the fetch's timeout
                      until the rows land in Redis, then read their header. Should the replica that accepted
                      it be gone (its marker expired or released, its image bytes still in Redis), B takes
                      the image over: it accepts it as its own encode would (probe, queue room, a pin for
                      the lease), and a flight here claims and encodes it; the fetch then reads that
                      flight's rows. Outcomes as errors: the encode failed -> that replica's error kind (a
                      decode error stays 400; rows that could not be stored -> 404 saying why); nobody has
                      it -> 404; timeout -> 504; Redis unreachable -> 503 at once (the id may exist
                      elsewhere: this replica cannot tell now; the project's clients retry).
  rows (replica B)    `rows_elsewhere`: the rows from the replica the directory names (peers.py), else a row
                      copy, else B takes the image over. Who may take an image over is decided by its claim:
                      a replica gone, or alive but silent to row requests (frozen: its claim expires within
                      seconds; its port filtered: it goes on renewing it), holds none on an id whose rows
                      landed (landing settles the claim), so B claims it at once and encodes it here (peers.py
                      stops asking a silent replica for a while, so this takes about one answer bound, 1 s);
                      an id whose claim is still renewed is still being encoded there: B's flight waits for
                      its outcome on Redis (or the claim's expiry), within the caller's timeout, never on an
                      HTTP answer. A replica refusing B's signature (another --auth-token) is a 503 naming
                      the mismatch, not a take-over: a configuration error to fix, not to hide.

Without Redis there is nothing to wait on: a fetch must reach the replica that encoded the id (the chart's
`service.sessionAffinity: ClientIP` does that for one client pod; deploy/README.md, "Scaling out").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from encoder_service import errors
from encoder_service.cache import CacheKey, EmbeddingStore, Marked, Settled, other_content
from encoder_service.cache.keys import CALLER_PREFIX
from encoder_service.core.flight import Flight, Flights
from encoder_service.core.images import ImageReader, Probed
from encoder_service.core.metrics import Metrics
from encoder_service.core.peers import Peers
from encoder_service.core.timeouts import Deadline
from encoder_service.engine.engine import Engine

log = logging.getLogger(__name__)


class GroupClaim(NamedTuple):
    """What `mark` claims for one frame group of a video: its key and the video's content tag. No bytes are
    kept beside it (`data`): another replica cannot encode one group of a video from them, so a fetch of a
    group whose replica died answers 404 within the claim's TTL (encode the video again)."""

    key: CacheKey
    content_tag: int
    data: None = None


class Replicas:
    """`row_bytes`: one row's bytes (what a taken-over id's pin reserves per token); `peers`: the row path to
    other replicas (None: no Redis)."""

    def __init__(self, store: EmbeddingStore, metrics: Metrics, *, flights: Flights, images: ImageReader,
                 engine: Engine, row_bytes: int, peers: Peers | None):
        self.store, self.metrics = store, metrics
        self._flights, self._images, self._engine, self._row_bytes = flights, images, engine, row_bytes
        self._peers = peers
        self._failing = False  # the last marking failed: log again only after one succeeds

    @property
    def enabled(self) -> bool:
        return self.store.redis is not None

    # ---- encode ----------------------------------------------------------------------------------------
    async def bind_tags(self, tags: dict[CacheKey, int]) -> dict[str, int]:
        """Bind these caller ids (key -> the content tag of the bytes the request sent) in Redis, first come
        first served across replicas: by name, the tag each id is bound to now (another replica's, where it
        bound the id first: a Conflict). {} without Redis, or when Redis cannot tell (down: the encode goes
        on, as it does without Redis). Unavailable right after Redis came back for ids not bound yet."""
        if not self.enabled or not tags:
            return {}
        return await self.store.bind_tags({key.name: tag for key, tag in tags.items()})

    def mark(self, misses: Sequence[Probed | GroupClaim], hits: Sequence[CacheKey]) -> asyncio.Task | None:
        """Start claiming `misses` (each marker with its content tag, an image's bytes beside it: a video's
        frame group keeps none, so no other replica can take it over) and sharing the
        local `hits` (one Redis round trip each, together); None without Redis or ids. The task never raises;
        it returns the claims' `Marked` (None when nothing was claimed). The encode awaits it before
        answering, and each miss's fill awaits it before it encodes: a marker must be set before the
        outcome that settles it can be published, and an image claimed elsewhere is not encoded here."""
        if not self.enabled or not (misses or hits):
            return None
        return asyncio.create_task(self._mark(list(misses), list(hits)), name="mark pending")

    async def _mark(self, misses: list[Probed], hits: list[CacheKey]) -> Marked | None:
        marked, _ = await asyncio.gather(self._pending(misses), self._share(hits))
        return marked

    async def _share(self, hits: list[CacheKey]) -> None:
        try:
            await self.store.share(hits)
        except Exception:  # never fatal to the encode (a fetch elsewhere of an evicted id answers 404)
            # The tier answers Redis faults itself (counted, logged once): what reaches here is a bug.
            log.warning("sharing %d local hits failed", len(hits), exc_info=True)

    async def _pending(self, images: list[Probed | GroupClaim]) -> Marked | None:
        if not images:
            return None
        try:
            marked = await self.store.mark_pending([p.key for p in images],
                                                   tags={p.key.name: p.content_tag for p in images},
                                                   inputs={p.key.name: p.data for p in images})
        except Exception:  # never fatal to the encode; Redis faults the tier answers itself: this is a bug
            log.warning("marking %d ids pending failed", len(images), exc_info=True)
            return None
        if marked:
            self._failing = False
            return marked
        self.metrics.pending_unmarked.inc(len(images))
        if not self._failing:
            self._failing = True
            log.warning("ids accepted here could not be marked pending in Redis (down, full or busy): until "
                        "that works again, fetches of them on other replicas answer at once instead of waiting")
        return marked

    # ---- fetch -----------------------------------------------------------------------------------------
    async def num_tokens_elsewhere(self, key: CacheKey, deadline: Deadline) -> int:
        """The row count of `key`, which no tier here has: once the encode another replica accepted lands in
        Redis, within `deadline`; or, should that replica be gone, of the flight here that took it over.
        Raises the error the fetch answers otherwise."""
        if not self.enabled:
            raise errors.NotFound(f"unknown id {key.id!r}: never encoded here, or evicted (encode it again; "
                                  "without Redis a fetch must reach the replica that encoded the id)")
        settled = await self.store.wait_for(key, deadline.left())  # raises EncodeFailed: A's error, A's kind
        if settled is Settled.LANDED:
            header = await self.store.header(key)
            if header is not None:
                return header.num_rows
            raise errors.NotFound(f"id {key.id!r} was encoded on another replica, but Redis lost where its rows "
                                  "are before they could be read (evicted: encode it again)")
        if settled is Settled.ORPHANED:
            flight = await self._take_over(key)
            if flight is not None:
                return flight.num_tokens
            settled = Settled.NOT_PENDING  # its bytes went meanwhile (settled or expired)
        if settled is Settled.NOT_PENDING:
            raise errors.NotFound(f"unknown id {key.id!r}: no rows for it here or in Redis, and no live replica "
                                  "is encoding it (never encoded, evicted, or the replica that accepted it "
                                  "stopped before storing its rows; encode it again)")
        if settled is Settled.TIMED_OUT:
            if deadline.dont_wait:
                raise errors.DeadlineExceeded(f"timeout_s=0 (don't wait) and id {key.id!r} is still encoding on "
                                              "another replica")
            raise errors.DeadlineExceeded(f"id {key.id!r} is encoding on another replica and its rows did not "
                                          f"land within timeout_s={deadline.timeout_s}")
        raise errors.Unavailable(f"id {key.id!r} is not on this replica, and the shared Redis tier, where other "
                                 "replicas' rows are, is unreachable or has just come back: retry")

    async def rows_elsewhere(self, key: CacheKey, start: int, end: int, deadline: Deadline) -> torch.Tensor | None:
        """Rows [start, end) of `key`, which no tier here has: from the replica the directory names (only
        those rows, over its row path: peers.py; passed on, not kept here). Should that replica be gone,
        or no longer hold them, a row copy in Redis answers, else this replica takes the image over (encodes it
        from the bytes kept in Redis, once across replicas: a flight here claims it) and answers from that
        flight. None: nobody has the rows nor the bytes (404). Unavailable while Redis is down."""
        if self._peers is None:
            return None
        rows, located = await self._peers.from_owner(self.store, key, start, end, copy=False)
        if rows is not None:  # passed on, not kept: their pages go back to the pool for the next pull (warm)
            return rows
        if located is not None and located.copy:
            rows = await self.store.read_rows(key, start, end)
            if rows is not None:
                return rows
        flight = await self._take_over(key)
        if flight is None:
            return None
        with self._flights.waiting(key.name):
            landed = await asyncio.shield(flight.task)
        return landed.entry.rows(start, end)

    async def _take_over(self, key: CacheKey) -> Flight | None:
        """The flight here of an image whose accepting replica is gone: accepted here as an encode would
        (probe, queue room: Overloaded when full, a pin for the lease when room is left), from the bytes that
        replica kept in Redis. None when they are gone too."""
        flight = self._flights.get(key.name)
        if flight is not None:
            return flight
        data = await self.store.input(key)
        if data is None:
            return None
        caller_id = key.id[len(CALLER_PREFIX):] if key.id.startswith(CALLER_PREFIX) else None
        loop = asyncio.get_running_loop()
        image = await loop.run_in_executor(self._engine.cpu_pool, self._images.probe, 0, data, caller_id)
        if image.key.name != key.name:  # not the bytes of this id: never encode them under it
            log.warning("image bytes kept in Redis for %s hash to %s: ignored", key.name, image.key.name)
            return None
        if caller_id is not None and other_content(image.content_tag, (await self.bind_tags(
                {key: image.content_tag})).get(key.name, 0)):  # bytes of a request that lost the id: ignored
            log.warning("image bytes kept in Redis for %s are not what the id names: ignored", key.name)
            return None
        flight = self._flights.get(key.name)  # another fetch may have taken it over meanwhile
        if flight is not None:
            return flight
        (permit,) = self._engine.admit(1)
        with contextlib.suppress(errors.Overloaded):  # pins full: served all the same, from Redis after
            self.store.pin(key, nbytes=image.num_tokens * self._row_bytes)
        log.info("id %s: the replica that accepted it is gone; encoding it here", key.id)
        # One waiter for the lease, as the encode that accepted it held: a fetch that leaves does not drop it.
        return self._flights.join(image, permit, after=self.mark([image], []))
