"""`Shared`: the face (face.py) of replicas sharing one Redis (redis_tier.py; standalone, Cluster or Sentinel).

Behind one Service, an LLM server's `encode` and its `fetch` of the same id may reach different replicas,
two replicas may be asked for the same new image at once, and a replica may die mid-encode. The rows stay on
the replica that made them; Redis holds the directory (directory.py): where each id's rows are, each
replica's address, caller ids' bindings, each accepted image's claim with its bytes beside it.

  encode (replica A)  `bind_tags(caller ids)`: before admitting anything, each caller id of the request is
                      bound in Redis to the content tag of its bytes, first come first served: an id another
                      replica bound to other bytes is a Conflict here, whatever raced, so an id names one
                      content on every replica (and the loser admits, claims and keeps nothing).
                      `mark(misses, hits)`: the images it admitted to its engine (its misses) are claimed in
                      Redis before it answers, with their bytes, so that a fetch anywhere waits for them and
                      can encode them itself should A die; one that another replica claimed first is not
                      encoded here too (its flight waits for that replica's rows: core/flight.py). A claim
                      that cannot be written (Redis down or full, an error) does not fail the encode: the id
                      is served here as before, its marker written once Redis takes it again, and until
                      then a fetch elsewhere answers at once. Counted (`encoder_pending_unmarked_total`),
                      logged once per run of failures. Its local hits are shared (announce.py: share).
  fetch (replica B)   `num_tokens_elsewhere(key, deadline)`: for an id no tier here knows (not in flight, not
                      in the store, no entry in Redis), wait within what is left of the fetch's timeout
                      until the rows land in Redis, then read their header. Should the replica that accepted
                      it be gone (its marker expired or released, its image bytes still in Redis), B takes
                      the image over (the core's `TakeOver`: it accepts it as its own encode would, and a
                      flight here claims and encodes it); the fetch then reads that flight's rows. Outcomes
                      as errors: the encode failed -> that replica's error kind (a decode error stays 400;
                      rows that could not be stored -> 404 saying why); nobody has it -> 404; timeout -> 504;
                      Redis unreachable -> 503 at once (the id may exist elsewhere: this replica cannot tell
                      now; the project's clients retry).
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

Reads go to the store first, then Redis: `get` (a row copy another replica wrote is kept here and settles
this replica's claim), `header`, `read_rows` (a row copy's GETRANGE). `put` writes the rows' location behind
(with a row copy for entries up to --redis-row-copy-bytes); once written, or when they cannot be, the id's
claim settles; `failed` publishes the failure (or releases the claim).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from encoder_service import errors
from encoder_service.cache import CacheKey, EmbeddingStore, Entry, EntryHeader
from encoder_service.replicas import background
from encoder_service.replicas.announce import Announcer
from encoder_service.replicas.directory import Located, Marked, Settled
from encoder_service.replicas.face import Claimed, Key, TakeOver
from encoder_service.replicas.peers import PeerAuthMismatch, Peers
from encoder_service.replicas.redis_tier import RedisTier
from encoder_service.timeouts import Deadline

log = logging.getLogger(__name__)


def _name(key: Key) -> str:
    return key.name if isinstance(key, CacheKey) else key


def _names(keys: Iterable[Key]) -> list[str]:
    """Their names, each once, in order."""
    return list(dict.fromkeys(_name(k) for k in keys))


class Shared:
    """Over `store` (this process's) and `redis` (the tier, not started); `peers`: the row path to other
    replicas; `layout`: the rows' (models/spec.py); `on_unmarked(n)`: n ids accepted here could not be claimed."""

    def __init__(self, store: EmbeddingStore, redis: RedisTier, peers: Peers, *, layout: str,
                 on_unmarked: Callable[[int], None] = lambda n: None):
        self.store, self.redis, self.peers = store, redis, peers
        self.owner = redis.owner
        self._layout, self._on_unmarked = layout, on_unmarked
        self.announcer = Announcer(store, redis, lease_s=store.lease_s)
        self._tasks: list[asyncio.Task] = []
        self._failing = False  # the last marking failed: log again only after one succeeds

    # ---- lifecycle and what is shown --------------------------------------------------------------------
    @property
    def owner_url(self) -> str | None:
        return self.redis.owner_url

    def advertise(self, url: str | None) -> None:
        self.redis.owner_url = url

    async def start(self) -> None:
        await self.redis.start()
        self._tasks = [asyncio.create_task(self.announcer.run(), name="announce-held-ids")]

    async def close(self) -> None:
        await background.stop(self._tasks)
        await self.redis.close()
        self.peers.close()

    def readiness(self) -> dict:
        """Redis down leaves the service ready: it serves from its store and encodes on."""
        return {"redis": self.redis.state, "redis_detail": self.redis.describe()}

    def stats(self) -> dict:
        out = {**self.announcer.counters, **self.store.stats()}
        for prefix, values in (("redis", self.redis.stats()), ("peer", self.peers.stats())):
            out.update((f"{prefix}_{name}", value) for name, value in values.items())
        return out

    # ---- reads: the store, then Redis ---------------------------------------------------------------------
    async def get(self, key: Key) -> Entry | None:
        """Whole entry from the store, else a row copy in Redis: a Redis hit (another replica's rows) is kept
        in the store and settles the id's pending marker if this replica set one."""
        name = _name(key)
        entry = self.store.get(name)
        if entry is None:
            entry = await self.redis.reads.get(name)
            if entry is not None:
                self.redis.writes.mark_landed(name)
                self.store.put(name, entry)
        return entry

    async def header(self, key: Key) -> EntryHeader | None:
        """From the store, else Redis's directory (the rows stay where they are, nothing is kept here).
        Unavailable while Redis is down."""
        name = _name(key)
        entry = self.store.peek(name)
        if entry is not None:
            return entry.header
        located = await self.redis.reads.locate(name)
        return located.header if located is not None else None

    async def locate(self, key: Key, *, strict: bool = True) -> Located | None:
        return await self.redis.reads.locate(_name(key), strict=strict)

    async def read_rows(self, key: Key, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) of the store's entry, else of a row copy in Redis (GETRANGE, verified); None
        when neither has them (another replica may: `locate`). InvalidInput when the range is outside the
        entry; Unavailable while Redis is down."""
        name = _name(key)
        entry = self.store.get(name)
        if entry is not None:
            return entry.rows(start, end)
        return await self.redis.reads.read_rows(name, start, end)

    async def pull(self, key: CacheKey) -> Entry | None:
        """The rows another replica holds (the directory says which), pulled whole over its row path (peers.py:
        bounded however long the lease, its owner silent or not); None when no live replica gives them."""
        located = await self.locate(key, strict=False)
        if located is None or located.url is None:
            return None
        try:
            rows, located = await self.peers.from_owner(self.redis.reads, key, 0, located.header.num_rows, copy=True,
                                                        strict=False)
        except PeerAuthMismatch:  # logged there; the caller has the image: it encodes it here instead
            return None
        if rows is None:
            return None
        return Entry.from_rows(rows, located.header.grid_thw, self._layout, copy=False,
                               content_tag=located.header.content_tag)

    # ---- writes -------------------------------------------------------------------------------------------
    def put(self, key: Key, entry: Entry) -> None:
        """Into the store, and the rows' location written behind to Redis (with a copy of the rows when they
        are small enough: --redis-row-copy-bytes); once written, or when they cannot be, the id's pending
        marker settles."""
        name = _name(key)
        self.store.put(name, entry)
        self.redis.writes.write_behind(name, entry)

    def failed(self, key: Key, exc: BaseException) -> None:
        """Fetches waiting on other replicas answer this error instead of waiting on the id's marker until its
        lease ends (or, for a fault of this replica's own, one of them encodes it)."""
        self.redis.writes.mark_failed(_name(key), exc)

    async def withdraw(self, key: Key, tag: int) -> None:
        """Its claim and kept bytes go and the id's binding names the rows that exist, so nothing waits on the
        claim of a request that was a Conflict."""
        await self.redis.bindings.withdraw(_name(key), tag)

    # ---- an encode's claims, bindings and waits -------------------------------------------------------------
    async def bind_tags(self, tags: Mapping[CacheKey, int]) -> dict[str, int]:
        """Bind these caller ids (key -> the content tag of the bytes the request sent) in Redis, first come
        first served across replicas (bindings.py): by name, the tag each id is bound to now (another
        replica's, where it bound the id first: a Conflict). {} when Redis cannot tell (down: the encode goes
        on, as it does without Redis). Unavailable right after Redis came back for ids not bound yet."""
        if not tags:
            return {}
        return await self.redis.bindings.bind_tags({key.name: tag for key, tag in tags.items()})

    def mark(self, misses: Sequence[Claimed], hits: Sequence[CacheKey]) -> asyncio.Task | None:
        """Start claiming `misses` (each marker with its content tag, an image's bytes beside it: a video's
        frame group keeps none, so no other replica can take it over) and sharing the local `hits` (one Redis
        round trip each, together); None without ids. The task never raises; it returns the claims' `Marked`
        (None when nothing was claimed). The encode awaits it before answering, and each miss's fill awaits
        it before it encodes: a marker must be set before the outcome that settles it can be published, and
        an image claimed elsewhere is not encoded here."""
        if not (misses or hits):
            return None
        return asyncio.create_task(self._mark(list(misses), list(hits)), name="mark pending")

    async def _mark(self, misses: list[Claimed], hits: list[CacheKey]) -> Marked | None:
        marked, _ = await asyncio.gather(self._pending(misses), self._share(hits))
        return marked

    async def _share(self, hits: list[CacheKey]) -> None:
        try:
            await self.share(hits)
        except Exception:  # never fatal to the encode (a fetch elsewhere of an evicted id answers 404)
            # The tier answers Redis faults itself (counted, logged once): what reaches here is a bug.
            log.warning("sharing %d local hits failed", len(hits), exc_info=True)

    async def _pending(self, images: list[Claimed]) -> Marked | None:
        if not images:
            return None
        try:
            marked = await self.mark_pending([p.key for p in images],
                                             tags={p.key.name: p.content_tag for p in images},
                                             inputs={p.key.name: p.data for p in images})
        except Exception:  # never fatal to the encode; Redis faults the tier answers itself: this is a bug
            log.warning("marking %d ids pending failed", len(images), exc_info=True)
            return None
        if marked:
            self._failing = False
            return marked
        self._on_unmarked(len(images))
        if not self._failing:
            self._failing = True
            log.warning("ids accepted here could not be marked pending in Redis (down, full or busy): until "
                        "that works again, fetches of them on other replicas answer at once instead of waiting")
        return marked

    async def share(self, keys: Iterable[Key]) -> int:
        """Ids an `encode` answers from the store (announce.py: share); returns how many were written again."""
        return await self.announcer.share(_names(keys))

    async def mark_pending(self, keys: Iterable[Key], lease_s: float | None = None,
                           tags: Mapping[str, int] | None = None, inputs: Mapping[str, bytes] | None = None
                           ) -> Marked:
        """Before `encode` answers: claim the ids it will create in Redis, for their lease at most (default:
        the store's), so a fetch on another replica waits for them and another replica asked for the same
        image does not encode it too (`Marked.elsewhere`: the names another replica claimed first); `tags`:
        the content tags of caller ids' bytes, `inputs`: the image bytes, by name. Not `ok` when not marked
        now."""
        return await self.redis.pending.mark_pending(_names(keys), self.store.lease_s if lease_s is None else lease_s,
                                             tags, inputs)

    async def wait_for(self, key: Key, timeout_s: float | None) -> Settled:
        """For a fetch that missed every tier (or a flight whose image another replica claimed): wait until
        another replica's encode of `key` lands in Redis (LANDED: read again), or ORPHANED once that replica
        is gone (encode `input(key)` here), or NOT_PENDING at once when none is under way (404); TIMED_OUT
        past `timeout_s` (timeouts.py: None no bound, 0 don't wait), UNAVAILABLE when Redis is down.
        Raises `EncodeFailed` when that encode failed."""
        label = key.id if isinstance(key, CacheKey) else key
        return await self.redis.pending.wait_for(_name(key), timeout_s, label)

    async def input(self, key: Key) -> bytes | None:
        """None when none are kept, or while Redis is down."""
        return await self.redis.reads.input(_name(key))

    # ---- a fetch of an id no tier here has ------------------------------------------------------------------
    async def num_tokens_elsewhere(self, key: CacheKey, deadline: Deadline, take_over: TakeOver) -> int:
        """The row count of `key`, which no tier here has: once the encode another replica accepted lands in
        Redis, within `deadline`; or, should that replica be gone, of the flight here that took it over.
        Raises the error the fetch answers otherwise."""
        settled = await self.wait_for(key, deadline.left())  # raises EncodeFailed: A's error, A's kind
        if settled is Settled.LANDED:
            header = await self.header(key)
            if header is not None:
                return header.num_rows
            raise errors.NotFound(f"id {key.id!r} was encoded on another replica, but Redis lost where its rows "
                                  "are before they could be read (evicted: encode it again)")
        if settled is Settled.ORPHANED:
            num_tokens = await take_over.num_tokens(key)
            if num_tokens is not None:
                return num_tokens
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

    async def rows_elsewhere(self, key: CacheKey, start: int, end: int, take_over: TakeOver
                             ) -> torch.Tensor | None:
        """Rows [start, end) of `key`, which no tier here has: from the replica the directory names (only
        those rows, over its row path: peers.py; passed on, not kept here). Should that replica be gone, or no
        longer hold them, a row copy in Redis answers, else this replica takes the image over (encodes it
        from the bytes kept in Redis, once across replicas: a flight here claims it). None: nobody has the
        rows nor the bytes (404). Unavailable while Redis is down."""
        rows, located = await self.peers.from_owner(self.redis.reads, key, start, end, copy=False)
        if rows is not None:  # passed on, not kept: their pages go back to the pool for the next pull (warm)
            return rows
        if located is not None and located.copy:
            rows = await self.read_rows(key, start, end)
            if rows is not None:
                return rows
        return await take_over.rows(key, start, end)
