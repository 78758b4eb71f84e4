"""What this replica holds, kept known in Redis: the ids of its store whose location Redis lost are written
again (`share`), and the caller ids it holds have their bindings written again (`bind_again`), round robin
(`run`), at once after an outage.

Redis evicts by its own LRU, which never sees a hit served from a replica's own store, so an id used here
all the time may be gone there; and a restarted Redis is empty. Without this, other replicas' fetches of
ids held here would answer 404, and another replica could bind a caller id held here to other bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Mapping

from encoder_service.cache import EmbeddingStore
from encoder_service.replicas.bindings import RETIRED
from encoder_service.replicas.redis_tier import RedisTier

log = logging.getLogger(__name__)
_REBIND_ALL_BATCH = 4096  # bindings written again per round trip after an outage (all of them, at once)


class Announcer:
    """`rebind_s`, `rebind_batch`: every `rebind_s` the next `rebind_batch` ids of the store are announced."""

    def __init__(self, store: EmbeddingStore, redis: RedisTier, *, lease_s: float, rebind_s: float = 1.0,
                 rebind_batch: int = 1024):
        self.store, self.redis, self.lease_s = store, redis, lease_s
        self.rebind_s, self.rebind_batch = rebind_s, rebind_batch
        self.counters = dict(reshared=0, bindings_lost=0)

    async def share(self, names: list[str]) -> int:
        """Ids an `encode` answers from the store: another replica may fetch them. Those Redis evicted are
        marked pending for the lease and written again from the store (a fetch elsewhere waits for the
        write); the others are only touched in Redis (its LRU follows their use here). Returns how many
        were written again."""
        missing = {name: entry for name in await self.redis.writes.touch(names)
                   if (entry := self.store.peek(name)) is not None}
        if not missing:
            return 0
        await self.redis.pending.mark_pending(list(missing), self.lease_s,
                                      {name: entry.header.content_tag for name, entry in missing.items()})
        for name, entry in missing.items():  # each write, once it lands, settles its marker
            self.redis.writes.write_behind(name, entry)
        self.counters["reshared"] += len(missing)
        return len(missing)

    async def run(self) -> None:
        """Keep what this replica holds known in Redis: every `rebind_s` the next `rebind_batch` ids of the
        store (round robin), each caller id's binding written again where Redis lost it (`bind_again`), and
        each id's location written again where Redis lost it (`share`: its LRU may have evicted it). Each
        time Redis comes back after an outage (or restarted: it is empty), every caller id's binding at once
        (bindings are small, and other replicas may bind other bytes once Redis's grace ends), then every id
        held here again, the leased ones and the most recently used first, at the same rate: a large store
        does not flood Redis, and other replicas' fetches find the ids again."""
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
                        leased = self.store.local.leased_keys()
                        queue = list(dict.fromkeys([*leased, *reversed(self.store.local.names())]))
                        log.info("Redis is back after an outage or a restart: announcing the %d ids held here "
                                 "again (%d leased first), %d per %.3g s", len(queue), len(leased),
                                 self.rebind_batch, self.rebind_s)
                    if not queue:
                        queue = self.store.local.names()
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
        """name -> content tag of the caller ids among `names` (default: every entry) in the store."""
        tags = {}
        for name in self.store.local.names() if names is None else names:
            entry = self.store.peek(name)
            if entry is not None and entry.header.content_tag:
                tags[name] = entry.header.content_tag
        return tags

    async def bind_again(self, tags: Mapping[str, int]) -> list[str]:
        """Write again the bindings of caller ids this replica holds (`tags`: name -> its entry's tag) where
        Redis lost them. An id Redis now binds to other bytes (it lost everything about the id, then another
        replica accepted other bytes under it) names two contents, one here and one there: it is retired
        (bindings.py) and dropped here, so that neither caller is ever served the other's rows. Returns those
        dropped."""
        if not tags:
            return []
        bound = await self.redis.bindings.bind_tags(tags, again=True)
        lost = [name for name, tag in bound.items() if tag != tags[name]]
        if not lost:
            return []
        await self.redis.bindings.retire([name for name in lost if bound[name] != RETIRED])
        for name in lost:
            self.store.local.discard(name)
        log.warning("%d caller ids held here are bound to other bytes in Redis, or retired (Redis lost them, then "
                    "another replica accepted other bytes under them): retired and dropped here, e.g. %s",
                    len(lost), lost[0])
        self.counters["bindings_lost"] += len(lost)
        return lost
