"""Shared Redis tier: the directory of which replica holds which id's rows, the claims, bindings and image
bytes of the replicas (directory.py), and optional copies of small entries' rows. Best effort, never a wrong
answer, never a stalled request. One concept a part, all over one link to Redis (redis_link.py: the
settings, connections, health, claims, counters they share):

  - `reads` (redis_reads.py): where an id's rows are (`locate`), a row copy whole or by range, a header,
    an accepted image's kept bytes.
  - `writes` (write_behind.py): `write_behind` queues an entry's location (and row copy), written by one
    writer task in order with the claims' outcomes (`mark_failed`, `mark_landed`); a bounded queue that waits
    out an outage. `touch` finds which of a replica's local hits Redis lost the location of.
  - `pending` (pending.py): `mark_pending` claims ids at accept (SET NX, the image bytes beside the marker);
    `wait_for` is a fetch's (or a waiting flight's) wait on another replica, woken through one shared
    pub/sub connection (subscriber.py).
  - `bindings` (binding_writes.py; bindings.py): caller ids bound to one content, first come first served.
  - here: the start and stop, the heartbeat (it renews this replica's markers and its address until they
    settle, and writes them again after an outage), the state and counters.
  - Connections (redis_connections.py): standalone, Cluster or Sentinel; bounded: more operations than
    connections wait for one, and running out is never "Redis is down"; a connection error is retried once
    on a fresh connection.
  - Faults (redis_health.py): unreachable -> down (reads answer at once: a miss, or Unavailable where a miss
    would be a 404; writes wait), a probe brings it back, and a restart no command saw is seen by the
    heartbeat; for `recovery_grace_s` after, an id with no marker is "unavailable", not "unknown" (other
    replicas may not have written theirs again yet). An OOM reply to a write pauses writes, doubling while
    Redis stays full. Short, corrupt or foreign values are counted (and logged rarely) and read as misses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from redis.exceptions import RedisError

from encoder_service.replicas import background, directory
from encoder_service.replicas.binding_writes import Bindings
from encoder_service.replicas.directory import RELEASED, marker_name
from encoder_service.replicas.pending import Pending
from encoder_service.replicas.redis_connections import PoolTimeout, timeout
from encoder_service.replicas.redis_health import UNREACHABLE
from encoder_service.replicas.redis_link import RedisLink, RedisOptions
from encoder_service.replicas.redis_reads import DirectoryReads
from encoder_service.replicas.write_behind import WriteBehind

log = logging.getLogger("encoder_service.replicas.redis")


class RedisTier:
    def __init__(self, url: str, options: RedisOptions | None = None, **overrides):
        o = dataclasses.replace(options or RedisOptions(), **overrides)
        self.options = o
        self._link = link = RedisLink(url, o)
        self.owner, self.counters, self.health = link.owner, link.counters, link.health
        self._conns, self._subscriber = link.conns, link.subscriber
        self.reads = DirectoryReads(link)
        self.writes = WriteBehind(link, self.reads)
        self.pending = Pending(link, self.reads)
        self.bindings = Bindings(link)
        self._tasks: dict[str, asyncio.Task] = {}  # writer, heartbeat

    @property
    def owner_url(self) -> str | None:
        """Where other replicas fetch this one's rows (its HTTP port), advertised in the directory; None: nowhere."""
        return self._link.owner_url

    @owner_url.setter
    def owner_url(self, url: str | None) -> None:
        self._link.owner_url = url

    async def start(self) -> None:
        self.health.start()
        self._tasks["writer"] = asyncio.create_task(self.writes.run(), name="redis-tier-writer")
        self._tasks["heartbeat"] = asyncio.create_task(self._heartbeat_loop(), name="redis-tier-heartbeat")
        try:
            await self._look()  # its run id, from the start: a restart before the first beat counts
        except (*UNREACHABLE, PoolTimeout) as exc:
            self.health.mark_down(exc)
        except RedisError as exc:
            self.health.on_error(exc)

    async def close(self, drain_s: float = 2.0) -> None:
        """Give queued writes and outcomes up to `drain_s` to land (they are only a cache), release the ids
        still claimed here (waiters elsewhere take them over at once), then stop."""
        if self.health.up and "writer" in self._tasks:
            try:
                await asyncio.wait_for(self.writes.flush(), timeout=drain_s)
            except asyncio.TimeoutError:
                log.warning("redis tier: %d queued bytes not written at shutdown", self.writes.queued_bytes)
        await background.stop(self._tasks.values())
        await self.health.close()
        if self.health.up:  # gone: peers stop asking it at once, and waiters take its claims over
            names = [marker_name(k) for k in self._link.claims]
            try:
                await self._conns.pipelined(("delete", directory.replica_name(self.owner)),
                                            *(cmd for m in names for cmd in (("delete", m), ("publish", m, RELEASED))))
            except (RedisError, PoolTimeout) as exc:  # they expire within pending_ttl_s anyway
                log.debug("redis tier: releasing %d claims at shutdown failed: %r", len(names), exc)
        await self._subscriber.close()
        await self._conns.close()

    async def flush(self) -> None:
        """Wait until queued writes and notices are done (tests, shutdown)."""
        await self.writes.flush()

    async def recovered(self) -> None:
        """Returns the next time the tier is up again after being down."""
        await self.health.recovered()

    @property
    def up(self) -> bool:
        return self.health.up

    @property
    def state(self) -> str:
        """"up", "down" or "failing_over" (readiness detail, stats)."""
        return self.health.state

    def describe(self) -> dict:
        """Readiness detail: the kind of Redis (standalone, cluster, sentinel; None before the first connect),
        the tier's state, each primary's as last seen, and the pub/sub the claims' outcomes go by (sharded on a
        Cluster of Redis >= 7, else plain)."""
        return {"mode": self._conns.kind, "state": self.state, "nodes": dict(self.health.nodes),
                "pubsub": "sharded" if self._conns.sharded else "plain"}

    async def _heartbeat_loop(self) -> None:
        """Every `heartbeat_s` (and at once after a recovery): renew this replica's markers, or write them
        again where Redis lost them (an outage, a restart, an eviction)."""
        while True:
            try:
                async with timeout(self.options.heartbeat_s):
                    await self.health.wake.wait()
            except TimeoutError:
                pass
            self.health.wake.clear()
            if not self.health.up:
                continue
            try:
                await self._look()
                await self._link.claims.beat(self.health.epoch, writable=self.health.not_writing() is None)
            except PoolTimeout:
                pass  # busy: the next beat, well within pending_ttl_s
            except RedisError as exc:
                self.health.on_error(exc, writing=True)
            except Exception:  # a bug here must not stop the heartbeat silently: log it, keep beating
                log.exception("redis tier: heartbeat failed")

    async def _look(self) -> None:
        """Redis's state (a restart is a recovery: redis_health.py), its memory (the room image bytes may take:
        claims.py), and, where peers fetch its rows, this replica alive at its address."""
        memory = await self.health.check()
        self._link.claims.redis_memory(int(memory.get("maxmemory", 0)), int(memory.get("used_memory", 0)),
                                  evicts=memory.get("maxmemory_policy", "noeviction") != "noeviction")
        if self._link.owner_url is not None:
            await self._conns.run("set", directory.replica_name(self.owner), self._link.owner_url,
                                  px=self._link.pending_px)

    def stats(self) -> dict:
        return dict(
            self.counters,
            **self._conns.counters,
            **self._subscriber.counters,
            state=self.state,
            writes_paused=self.health.writes_paused(),
            queued_bytes=self.writes.queued_bytes,
            queued_notices=self.writes.queued_notices,
            pending_channels=self._subscriber.channels,
            pending_unsettled=len(self._link.claims),
            input_bytes=self._link.claims.input_bytes,
            inputs_skipped=self._link.claims.inputs_skipped,
            inputs_pushed_out=self._link.claims.inputs_pushed_out,
            error_replies=dict(self.health.error_reasons),
            nodes={node: int(state == "up") for node, state in self.health.nodes.items()},
        )
