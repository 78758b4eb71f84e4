"""The Redis tier's write-behind (redis_tier.py): `write_behind` queues an entry; one writer task (`run`) SETs
its location (this replica and the entry's header, with the TTL backstop) and, for an entry of at most
`row_copy_bytes`, a copy of its rows first, then settles the id's claim. The claims' outcomes (`mark_failed`,
`mark_landed`) are published behind the writes queued before them. The queue is bounded
(`max_queued_locations`, copies by `max_queued_bytes`: over it a copy is dropped, never the location;
outcomes by `max_queued_notices`); while Redis is unreachable what is queued waits, in order, and is written
once it is back. An OOM reply to a write pauses writes (redis_health.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

from redis.exceptions import OutOfMemoryError, RedisError

from encoder_service.cache.entry import Entry
from encoder_service.replicas import directory
from encoder_service.replicas.claims import Claim
from encoder_service.replicas.directory import LANDED
from encoder_service.replicas.redis_connections import PoolTimeout
from encoder_service.replicas.redis_health import UNREACHABLE
from encoder_service.replicas.redis_link import RedisLink, maybe_in_thread
from encoder_service.replicas.redis_reads import DirectoryReads

log = logging.getLogger("encoder_service.replicas.redis")


class WriteBehind:
    def __init__(self, link: RedisLink, reads: DirectoryReads):
        self._link, self._reads, self.options, self.counters = link, reads, link.options, link.counters
        self._conns, self.health, self._claims = link.conns, link.health, link.claims
        # Rows to write ("rows", key, Entry, epoch) and marker outcomes to publish ("settle", key, (value, claim),
        # epoch), with the epoch they were queued in.
        self._queue: asyncio.Queue[tuple[str, str, object, int]] = asyncio.Queue()
        self.queued_bytes = 0  # of the queued row copies
        self._queued_locations = 0
        self._writing: Counter[str] = Counter()  # keys of the queued row writes
        self.queued_notices = 0

    def write_behind(self, key: str, entry: Entry) -> bool:
        """Queue the rows' location (this replica holds them: directory.py) and, for an entry of at most
        `row_copy_bytes`, a copy of the rows; never blocks. Queued also while Redis is down (written once it
        is back). A copy is dropped (counted) while writes are paused by OOM or when the backlog of copies is
        full: the location is written all the same. False (counted) only when the queue of locations is full;
        then an id claimed here is settled as failed ("not stored"), so waiters elsewhere stop waiting."""
        if self._queued_locations >= self.options.max_queued_locations:
            self._dropped(key, "the write-behind queue to Redis was full", "writes_dropped_full")
            return False
        copy = 0 < entry.nbytes <= self.options.row_copy_bytes
        if copy and self.health.writes_paused():
            self.counters["copies_dropped"] += 1
            copy = False
        if copy and self.queued_bytes + entry.nbytes > self.options.max_queued_bytes:
            self.counters["copies_dropped_full"] += 1
            copy = False
        self.queued_bytes += entry.nbytes if copy else 0
        self._queued_locations += 1
        self._writing[key] += 1
        self._queue.put_nowait(("rows", key, (entry, copy), self.health.epoch))
        return True

    async def flush(self) -> None:
        """Wait until queued writes and notices are done (tests, shutdown)."""
        await self._queue.join()

    def mark_failed(self, key: str, exc: BaseException) -> None:
        """The encode of `key` claimed here ended without rows: publish the outcome (queued): the failure, so
        waiters elsewhere answer this error instead of waiting; or, for a fault of this replica's own
        (directory.outcome_of), the release, so one of them encodes it instead."""
        claim = self._claims.get(key)
        if claim is not None:
            self._notify(key, directory.outcome_of(exc), claim)

    def mark_landed(self, key: str) -> None:
        """`key` was claimed here but its rows were in Redis already (another replica wrote them): clear the
        marker and wake its waiters (queued). Rows this tier writes settle by themselves."""
        claim = self._claims.get(key)
        if claim is not None:
            self._notify(key, LANDED, claim)

    async def touch(self, keys: Sequence[str]) -> list[str]:
        """Of `keys` (entries this replica has in its local tier and was asked for again), those whose location
        Redis no longer has and this tier is not writing already. TOUCH also refreshes their LRU clock in
        Redis: a replica serving an id from its own tier sends Redis nothing else, so without it Redis would
        evict the ids most used here first. One round trip; [] (nothing to act on) while down or paused by
        OOM, or on an error."""
        if not keys or self.health.not_writing() is not None:
            return []
        found = await self._link.or_none(
            self._conns.pipelined(*(("touch", directory.location_name(k), k) for k in keys)))
        if found is None:
            return []
        return [k for k, n in zip(keys, found) if not n and k not in self._writing]

    async def run(self) -> None:
        """The one writer (a task of the tier's): the queue in order, each item tried `max_write_tries` times,
        waiting for Redis to be up before each."""
        while True:
            kind, key, item, epoch = await self._queue.get()
            try:
                for _ in range(self.options.max_write_tries):
                    await self.health.up_again.wait()
                    if await (self._write(key, *item, epoch) if kind == "rows" else self._settle(key, *item)):
                        break
                else:  # Redis went away during every try
                    if kind == "rows":
                        self._dropped(key, f"its write failed {self.options.max_write_tries} times")
                    else:
                        self.counters["notices_dropped"] += 1
            except Exception:  # a bug here must not kill the writer silently: log it, keep writing
                self.counters["writes_dropped" if kind == "rows" else "notices_dropped"] += 1
                log.exception("redis tier: %s of %s failed", "write" if kind == "rows" else "notice", key)
            finally:
                if kind == "rows":
                    self.queued_bytes -= item[0].nbytes if item[1] else 0
                    self._queued_locations -= 1
                    self._writing[key] -= 1
                    if not self._writing[key]:
                        del self._writing[key]
                else:
                    self.queued_notices -= 1
                self._queue.task_done()

    async def _write(self, key: str, entry: Entry, copy: bool, epoch: int) -> bool:
        """SET the rows' copy (when `copy`), then their location, then settle the marker (all queued in
        `epoch`). False when Redis went away meanwhile (try again once it is back); True when done: written,
        or dropped (OOM, an error reply). A copy Redis refuses is dropped alone; a location it refuses
        fails the id ("not stored": no replica could find its rows)."""
        if copy and not self.health.writes_paused():
            value = await asyncio.to_thread(entry.to_bytes, key)
            written = await self._write_command(("set", key, value, self._link.ttl_px), "copies_dropped")
            if written is None:
                return False
            self.counters["copies"] += written is True
            self._reads.drop_header(key)
        header = await maybe_in_thread(entry.nbytes, entry.stored_header, key)  # one pass over the rows
        location = directory.location_value(self._link.owner, header.pack(), entry.block_sums())
        written = await self._write_command(("set", directory.location_name(key), location, self._link.ttl_px))
        if written is None:
            return False
        if written is not True:
            self._dropped(key, "Redis is full" if isinstance(written, OutOfMemoryError) else "its write failed")
            return True
        self._reads.drop_location(key)
        self.counters["writes"] += 1
        self.counters["writes_after_outage"] += epoch != self.health.epoch  # it waited for Redis to come back
        # Every landed write wakes the fetches waiting for it, whichever replica marked it pending.
        return await self._settle(key, LANDED, None)

    async def _write_command(self, command: tuple, dropped: str | None = None) -> bool | RedisError | None:
        """Run one write: True when done, the error when Redis refused it (OOM, an error reply: counted under
        `dropped`), None when Redis went away (try again once it is back). A success after an OOM pause ended
        (its probe) ends the doubling; one during the pause ends nothing (a small write fits where rows do
        not)."""
        try:
            await self._conns.pipelined(command)
        except PoolTimeout:
            return None
        except RedisError as exc:
            self.health.on_error(exc, writing=True)
            if isinstance(exc, UNREACHABLE):
                return None
            if dropped is not None:
                self.counters[dropped] += 1
            return exc
        self.health.wrote()
        return True

    def _dropped(self, key: str, why: str, counter: str = "writes_dropped") -> None:
        self.counters[counter] += 1
        claim = self._claims.get(key)
        if claim is not None:
            self._notify(key, directory.failure_value(directory.NOT_STORED, f"its rows were not stored: {why}"), claim)

    def _notify(self, key: str, value: bytes, claim: Claim | None) -> None:
        """Queue a marker outcome behind the queued writes (bounded in count; over it the claim is dropped:
        no longer renewed, its marker expires and a waiter takes the image over). Its claim is renewed until
        the outcome is settled."""
        if self.queued_notices >= self.options.max_queued_notices:
            self.counters["notices_dropped"] += 1
            if claim is not None:
                self._claims.drop(key, claim)
            return
        self.queued_notices += 1
        self._queue.put_nowait(("settle", key, (value, claim), self.health.epoch))

    async def _settle(self, key: str, value: bytes, claim: Claim | None) -> bool:
        """Publish a queued outcome (claims.py: settle). False when Redis went away (settle again once it is
        back)."""
        try:
            settled = await self._claims.settle(key, value, claim, self.options.failure_ttl_s)
        except PoolTimeout:
            return False
        except RedisError as exc:
            self.health.on_error(exc, writing=True)
            if isinstance(exc, UNREACHABLE):
                return False
            if not isinstance(exc, OutOfMemoryError):  # under OOM the failure went out, its marker deleted
                self.counters["notices_dropped"] += 1
                return True
            settled = True
        self.counters["pending_settled"] += settled
        return True
