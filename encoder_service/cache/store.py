"""EmbeddingStore: the cache the core talks to (tiers + leases). It calls nothing back: the core's flights
(core/flight.py, the one single flight) read it, encode on a miss and put what the engine answered.

    store = EmbeddingStore(local_bytes, redis_url=None, redis_ttl_s=86400, lease_s=300,
                           max_pinned_bytes=local_bytes // 2)
    await store.start() ... await store.close()
    await store.get(key)                          -> Entry | None       local, then a row copy in Redis (promoted)
    store.put(key, entry)                                               local; its location written behind to Redis
    store.failed(key, exc)                                              an encode of `key` failed (Redis: published)
    store.peek(key)                               -> Entry | None       local only; no accounting, no LRU move
    await store.header(key)                       -> EntryHeader | None local, else Redis's directory
    await store.locate(key)                       -> Located | None     where another replica's rows are (Redis)
    await store.read_rows(key, start, end)        -> Tensor | None      local slice, else a row copy's GETRANGE
    await store.mark_pending(keys, tags=None, inputs=None) -> Marked    claims: other replicas wait for them
    await store.bind_tags({name: tag})            -> {name: tag}        caller ids bound to one content across replicas
    await store.wait_for(key, timeout_s)          -> Settled            a wait for another replica's encode
    await store.input(key)                        -> bytes | None       an accepted image's bytes kept in Redis
    await store.share(keys)                       -> int                local hits other replicas can find again
    store.pin(key, lease_s=None, nbytes=None)     raises Overloaded;    store.unpin(key) -> bool (an encode's own)
    store.delivered(key, num_rows, ranges) -> int  a fetch's rows: full deliveries end holders
    store.release(key) -> bool                     a client's release
    store.stats()                                 -> dict (flat counters)

`key` is a `CacheKey` (keys.py) or its full name. Tiers: the host LRU (`local_bytes`) always; Redis when
`redis_url` is set: the directory of who holds which id (the rows stay on the replica that made them, and
travel replica to replica over HTTP: core/peers.py), the claims, bindings and inputs, and, for entries of at
most `row_copy_bytes` (0 by default: none), a copy of the rows.

Across replicas (Redis only; cache/directory.py): `mark_pending` claims the ids an `encode` will create
before answering it (with the image bytes beside each marker); those another replica claimed first are
`Marked.elsewhere` (wait for its rows instead). What follows settles each claim: `get` finding a row copy
in Redis (another replica wrote it), `put` (the location lands through the write-behind, or cannot be
stored), or `failed` (the failure, or the release of an encode this replica gives up).
A fetch that misses everywhere calls `wait_for`: LANDED -> `locate` the rows, ORPHANED -> the replica
that accepted it is gone: encode `input(key)` here, NOT_PENDING -> 404, a failure is raised as
`EncodeFailed`. An `encode` answered from the local tier calls `share` for those ids: Redis may have evicted
their location (its LRU never sees a replica's local hits), and another replica's fetch must find them; so
does the store itself for every id leased here each time Redis comes back after an outage (a restarted
Redis is empty).

Leases, the flow the core follows (core/encoder.py):
  1. `encode`: `store.pin(key, nbytes=expected)` BEFORE answering (raises Overloaded -> 429 when pins are
     full), then the id's flight fills it in the background. The pin reserves the bytes until the entry lands.
  2. `fetch` chunks: `read_rows` (an id still in flight is read from its flight), then `delivered` with the
     rows the fetch sent: a chunked prefill reads an image over several chunks, and once every row has been
     delivered (since the pin began) one holder ends, so a client that fetches all rows and never releases
     holds its pin only that long. A fetch another replica makes for its client (core/peers.py) counts
     here as the client's; a replica copying the rows for itself ends nothing.
  3. Else the pin ends at `release(key)` (the client's "done" for that id, optional) or when the lease
     expires, whichever comes first. Pins are counted per holder: two requests encoding the same image each
     hold one. An encode that fails or is left before its answer gives its own pin back (`unpin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from encoder_service.cache.bindings import RETIRED
from encoder_service.cache.entry import Entry, EntryHeader
from encoder_service.cache.directory import Located, Marked, Settled
from encoder_service.cache.keys import CacheKey
from encoder_service.cache.local import LocalTier
from encoder_service.cache.redis_tier import RedisOptions, RedisTier

Key = CacheKey | str
log = logging.getLogger(__name__)
_REBIND_ALL_BATCH = 4096  # bindings written again per round trip after an outage (all of them, at once)


def _name(key: Key) -> str:
    return key.name if isinstance(key, CacheKey) else key


def _names(keys: Iterable[Key]) -> list[str]:
    """Their names, each once, in order."""
    return list(dict.fromkeys(_name(k) for k in keys))


class EmbeddingStore:
    def __init__(
        self,
        local_bytes: int,
        redis_url: str | None = None,
        *,
        redis_ttl_s: float = 86400,
        lease_s: float = 300,
        max_pinned_bytes: int | None = None,
        redis_options: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
        rebind_s: float = 1.0,
        rebind_batch: int = 1024,
    ):
        self.lease_s = lease_s
        self.local = LocalTier(
            local_bytes, local_bytes // 2 if max_pinned_bytes is None else max_pinned_bytes, clock=clock
        )
        self.redis = (RedisTier(redis_url, RedisOptions(ttl_s=redis_ttl_s, **(redis_options or {})))
                      if redis_url else None)
        self.counters = dict(reshared=0, bindings_lost=0)
        self.rebind_s, self.rebind_batch = rebind_s, rebind_batch
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        if self.redis is not None:
            await self.redis.start()
            self._tasks = [asyncio.create_task(self._announce(), name="announce-held-ids")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.redis is not None:
            await self.redis.close()

    # ---- reads ----------------------------------------------------------------------------------

    async def get(self, key: Key) -> Entry | None:
        """Whole entry from the local tier, else a row copy in Redis: a Redis hit (another replica's rows) is
        promoted to the local tier and settles the id's pending marker if this replica set one."""
        name = _name(key)
        entry = self.local.get(name)
        if entry is None and self.redis is not None:
            entry = await self.redis.get(name)
            if entry is not None:
                self.redis.mark_landed(name)
                self.local.put(name, entry)
        return entry

    def peek(self, key: Key) -> Entry | None:
        """The local tier's entry, or None; no hit/miss counted, no LRU promotion, no Redis."""
        return self.local.peek(_name(key))

    async def header(self, key: Key) -> EntryHeader | None:
        """The entry's header (num_rows, row_width, grid_thw, ...) from the local tier, else from Redis's
        directory (the rows stay where they are, nothing is promoted). Unavailable while Redis is down."""
        name = _name(key)
        entry = self.local.peek(name)
        if entry is not None:
            return entry.header
        located = await self.redis.locate(name) if self.redis is not None else None
        return located.header if located is not None else None

    async def locate(self, key: Key, *, strict: bool = True) -> Located | None:
        """Where another replica's rows of `key` are (cache/directory.py: Located), from Redis; None without
        Redis or when it has neither a location nor a row copy. `strict`: Unavailable while Redis is down,
        else None then."""
        return await self.redis.locate(_name(key), strict=strict) if self.redis is not None else None

    async def read_rows(self, key: Key, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) as a CPU tensor [end - start, row_width] (a read-only view) of the local tier's
        entry, else of a row copy in Redis (GETRANGE, verified); None when neither has them (another replica
        may: `locate`). InvalidInput when the range is outside the entry; Unavailable while Redis is down."""
        name = _name(key)
        entry = self.local.get(name)
        if entry is not None:
            return entry.rows(start, end)
        if self.redis is not None:
            return await self.redis.read_rows(name, start, end)
        return None

    def local_rows(self, key: Key, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) of the local tier's entry (a read-only view, an LRU hit), or None."""
        entry = self.local.get(_name(key))
        return entry.rows(start, end) if entry is not None else None

    def forget_location(self, key: Key, owner: str) -> None:
        """A fetch found that `owner` does not give `key`'s rows (gone, or lost them): both are looked up
        afresh next time."""
        if self.redis is not None:
            self.redis.forget_location(_name(key), owner)

    # ---- writes ---------------------------------------------------------------------------------

    def put(self, key: Key, entry: Entry) -> None:
        """An encode's rows: into the local tier, and their location written behind to Redis (with a copy of
        the rows when they are small enough: --redis-row-copy-bytes); once written, or when they cannot be,
        the id's pending marker settles."""
        name = _name(key)
        self.local.put(name, entry)
        if self.redis is not None:
            self.redis.write_behind(name, entry)

    def failed(self, key: Key, exc: BaseException) -> None:
        """The encode of `key` failed, or was dropped (cancelled: every caller left): with Redis, fetches
        waiting on other replicas answer this error instead of waiting on the id's marker until its lease
        ends. Nothing is cached."""
        if self.redis is not None:
            self.redis.mark_failed(_name(key), exc)

    async def withdraw(self, key: Key, tag: int) -> None:
        """An encode of caller id `key` found the id's rows elsewhere, of other content (`tag`): with Redis,
        its claim and kept bytes go and the id's binding names the rows that exist, so nothing waits on the
        claim of a request that was a Conflict."""
        if self.redis is not None:
            await self.redis.withdraw(_name(key), tag)

    # ---- across replicas ------------------------------------------------------------------------

    async def mark_pending(self, keys: Iterable[Key], lease_s: float | None = None,
                           tags: Mapping[str, int] | None = None, inputs: Mapping[str, bytes] | None = None
                           ) -> Marked:
        """Before `encode` answers: claim the ids it will create in Redis, for their lease at most (default:
        the store's), so a fetch on another replica waits for them and another replica asked for the same
        image does not encode it too (`Marked.elsewhere`: the names another replica claimed first); `tags`:
        the content tags of caller ids' bytes, `inputs`: the image bytes, by name. Not `ok` without Redis
        or when not marked now."""
        if self.redis is None:
            return Marked(False)
        return await self.redis.mark_pending(_names(keys), self.lease_s if lease_s is None else lease_s, tags,
                                             inputs)

    async def bind_tags(self, tags: Mapping[str, int]) -> dict[str, int]:
        """Bind caller ids (name -> the content tag of the bytes a request sent) to one content each across
        replicas, first come first served (cache/directory.py): by name, the tag each is bound to now (this one,
        or another replica's: a Conflict); {} without Redis, or when Redis cannot tell. Unavailable within
        moments of Redis coming back for an id not bound yet (retry)."""
        if self.redis is None:
            return {}
        return await self.redis.bind_tags(tags)

    async def wait_for(self, key: Key, timeout_s: float | None) -> Settled:
        """For a fetch that missed every tier (or a flight whose image another replica claimed): wait until
        another replica's encode of `key` lands in Redis (LANDED: read again), or ORPHANED once that replica
        is gone (encode `input(key)` here), or NOT_PENDING at once when none is under way (404); TIMED_OUT
        past `timeout_s` (core/timeouts.py: None no bound, 0 don't wait), UNAVAILABLE when Redis is down.
        Raises `EncodeFailed` when that encode failed. NOT_PENDING without Redis: a fetch must reach the
        encoding replica then."""
        if self.redis is None:
            return Settled.NOT_PENDING
        label = key.id if isinstance(key, CacheKey) else key
        return await self.redis.wait_for(_name(key), timeout_s, label)

    async def input(self, key: Key) -> bytes | None:
        """The bytes of an image another replica accepted, kept in Redis while it is encoded (cache/directory.py);
        None without Redis, when none are kept, or while Redis is down."""
        return None if self.redis is None else await self.redis.input(_name(key))

    async def share(self, keys: Iterable[Key]) -> int:
        """Ids an `encode` answers from the local tier: another replica may fetch them. Those Redis evicted are
        marked pending for the store's lease and written again from the local tier (a fetch elsewhere waits
        for the write); the others are only touched in Redis (its LRU follows their use here).
        Returns how many were written again; 0 without Redis."""
        if self.redis is None:
            return 0
        missing = {name: entry for name in await self.redis.touch(_names(keys))
                   if (entry := self.local.peek(name)) is not None}
        if not missing:
            return 0
        await self.redis.mark_pending(list(missing), self.lease_s,
                                      {name: entry.header.content_tag for name, entry in missing.items()})
        for name, entry in missing.items():  # each write, once it lands, settles its marker
            self.redis.write_behind(name, entry)
        self.counters["reshared"] += len(missing)
        return len(missing)

    async def _announce(self) -> None:
        """Keep what this replica holds known in Redis: every `rebind_s` the next `rebind_batch` ids of the
        local tier (round robin), each caller id's binding written again where Redis lost it (`bind_again`),
        and each id's location written again where Redis lost it (`share`: its LRU may have evicted it). Each
        time Redis comes back after an outage (or restarted: it is empty), every caller id's binding at once
        (bindings are small, and other replicas may bind other bytes once Redis's grace ends), then every id
        held here again, the leased ones and the most recently used first, at the same rate: a large local
        tier does not flood Redis, and other replicas' fetches find the ids again."""
        queue: list[str] = []
        recovered = asyncio.ensure_future(self.redis.recovered())
        try:
            while True:
                await asyncio.wait({recovered}, timeout=self.rebind_s)
                try:
                    if recovered.done():
                        recovered = asyncio.ensure_future(self.redis.recovered())
                        names = self._caller_tags()
                        for at in range(0, len(names), _REBIND_ALL_BATCH):
                            await self.bind_again(dict(itertools.islice(names.items(), at, at + _REBIND_ALL_BATCH)))
                        leased = self.local.leased_keys()
                        queue = list(dict.fromkeys([*leased, *reversed(self.local.names())]))
                        log.info("Redis is back after an outage or a restart: announcing the %d ids held here "
                                 "again (%d leased first), %d per %.3g s", len(queue), len(leased),
                                 self.rebind_batch, self.rebind_s)
                    if not queue:
                        queue = self.local.names()
                    batch, queue = queue[:self.rebind_batch], queue[self.rebind_batch:]
                    await self.bind_again(self._caller_tags(batch))
                    shared = await self.share(batch)
                    if shared:
                        log.info("wrote %d held ids to Redis again (it had lost them)", shared)
                except Exception:  # never fatal; the tier answers Redis faults itself: this is a bug
                    log.warning("announcing the ids held here to Redis failed", exc_info=True)
        finally:
            recovered.cancel()

    def _caller_tags(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """name -> content tag of the caller ids among `names` (default: every entry) in the local tier."""
        tags = {}
        for name in self.local.names() if names is None else names:
            entry = self.local.peek(name)
            if entry is not None and entry.header.content_tag:
                tags[name] = entry.header.content_tag
        return tags

    async def bind_again(self, tags: Mapping[str, int]) -> list[str]:
        """Write again the bindings of caller ids this replica holds (`tags`: name -> its entry's tag) where
        Redis lost them. An id Redis now binds to other bytes (it lost everything about the id, then another
        replica accepted other bytes under it) names two contents, one here and one there: it is retired
        (bindings.py) and dropped here, so that neither caller is ever served the other's rows. Returns those
        dropped."""
        if self.redis is None or not tags:
            return []
        bound = await self.redis.bind_tags(tags, again=True)
        lost = [name for name, tag in bound.items() if tag != tags[name]]
        if not lost:
            return []
        await self.redis.retire([name for name in lost if bound[name] != RETIRED])
        for name in lost:
            self.local.discard(name)
        log.warning("%d caller ids held here are bound to other bytes in Redis, or retired (Redis lost them, then "
                    "another replica accepted other bytes under them): retired and dropped here, e.g. %s",
                    len(lost), lost[0])
        self.counters["bindings_lost"] += len(lost)
        return lost

    # ---- leases ---------------------------------------------------------------------------------

    def pin(self, key: Key, lease_s: float | None = None, nbytes: int | None = None) -> None:
        """Keep `key` in the local tier for `lease_s` (default: the store's) or until `release`.
        `nbytes` reserves room when the entry is not there yet. Raises Overloaded when pins are full."""
        self.local.pin(_name(key), self.lease_s if lease_s is None else lease_s, nbytes)

    def unpin(self, key: Key) -> bool:
        """Give back a pin an encode just took (its request failed or its caller left)."""
        return self.local.unpin(_name(key))

    def delivered(self, key: Key, num_rows: int, ranges: Iterable[tuple[int, int]]) -> int:
        """A fetch delivered rows `ranges` of `key` (of `num_rows`): holders whose every row is delivered end
        (cache/local.py). Returns how many ended."""
        return self.local.delivered(_name(key), num_rows, ranges)

    def release(self, key: Key) -> bool:
        """A client is done with `key`: one holder of it ends (one a full fetch ended already, first)."""
        return self.local.release(_name(key))

    def stats(self) -> dict:
        """Flat dict: `local_*`, `redis_*` and the store's own counters, plus `redis_state`."""
        out = dict(self.counters)
        tiers = {"local": self.local.stats(), "redis": self.redis.stats() if self.redis else None}
        for tier, values in tiers.items():
            for name, value in (values or {}).items():
                out[f"{tier}_{name}"] = value
        return out
