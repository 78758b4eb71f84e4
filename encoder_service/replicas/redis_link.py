"""What the Redis tier's parts share (redis_tier.py builds them over one): its settings (`RedisOptions`), the
connections (redis_connections.py: standalone, Cluster or Sentinel), their health (redis_health.py), the
one pub/sub connection every wait shares (subscriber.py), this replica's claims (claims.py) and its name in
the directory, the tier's counters; and how a part runs a best-effort command (`or_none`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from redis.exceptions import RedisError

from encoder_service.replicas.claims import Claims
from encoder_service.replicas.redis_connections import Connections, PoolTimeout
from encoder_service.replicas.redis_health import UNREACHABLE, RedisHealth
from encoder_service.replicas.subscriber import Subscriber

T = TypeVar("T")

# Verify (hash) values larger than this in a worker thread so the event loop keeps serving.
_THREAD_BYTES = 1 << 20


@dataclass(frozen=True)
class RedisOptions:
    """The tier's settings (the service sets ttl_s, owner_url and row_copy_bytes; the rest are defaults tests
    shorten)."""

    ttl_s: float = 86400  # entries' and the directory's backstop TTL (--redis-ttl-s)
    owner_url: str | None = None  # where other replicas fetch this one's rows (its HTTP port)
    row_copy_bytes: int = 0  # entries up to this size also get a copy of their rows in Redis (0: none)
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    max_connections: int = 64
    pool_wait_s: float = 2.0
    max_queued_bytes: int = 512 << 20  # row copies waiting to be written
    max_queued_locations: int = 65536  # locations waiting to be written (a few hundred bytes each)
    max_queued_notices: int = 4096  # claims' outcomes waiting to be published
    max_write_tries: int = 3
    probe_min_s: float = 0.25
    probe_max_s: float = 1.0
    recovery_grace_s: float = 3.0  # > the heartbeat: every replica sees a restart and writes its bindings again
    oom_pause_min_s: float = 0.5
    oom_pause_max_s: float = 30.0
    header_cache_size: int = 4096
    replica_url_cache_s: float = 1.0  # how long a directory read (a location, a replica's address) is kept
    failure_ttl_s: float = 60.0
    pending_ttl_s: float = 4.0
    heartbeat_s: float = 1.0
    max_marked: int = 65536
    max_input_bytes: int = 256 << 20


class RedisLink:
    def __init__(self, url: str, o: RedisOptions):
        self.options = o
        self.ttl_px = int(o.ttl_s * 1000)
        self.pending_px = int(o.pending_ttl_s * 1000)
        self.owner_url = o.owner_url  # where other replicas fetch this one's rows (set before the start)
        self.conns = Connections(url, max_connections=o.max_connections, wait_s=o.pool_wait_s,
                                 socket_timeout_s=o.socket_timeout_s, connect_timeout_s=o.connect_timeout_s)
        # This replica's claims; the owner in their markers names this process (its replica, this run).
        self.claims = Claims(self.conns, uuid.uuid4().hex[:12], pending_ttl_s=o.pending_ttl_s,
                             max_claims=o.max_marked, max_input_bytes=o.max_input_bytes)
        self.owner = self.claims.owner
        self.subscriber = Subscriber(self.conns.pubsub_route, self._on_subscriber_lost)
        self.counters = dict(
            hits=0, misses=0, range_hits=0, corrupt=0, errors=0, down_events=0, oom_events=0,
            writes=0, writes_dropped=0, writes_dropped_full=0, writes_after_outage=0, skipped_down=0,
            located=0, copies=0, copies_dropped=0, copies_dropped_full=0,
            notices_dropped=0, bindings_checked=0, restarts_seen=0, pending_marked=0, pending_elsewhere=0,
            pending_settled=0, pending_waits=0,
            pending_wakeups=0, pending_timeouts=0, pending_failures=0, pending_orphaned=0,
        )  # fmt: skip
        self.health = RedisHealth(self.conns, self.subscriber, self.conns.target.shown, self.counters,
                                  probe_min_s=o.probe_min_s,
                                  probe_max_s=o.probe_max_s, recovery_grace_s=o.recovery_grace_s,
                                  oom_pause_min_s=o.oom_pause_min_s, oom_pause_max_s=o.oom_pause_max_s)

    async def or_none(self, command: Awaitable[T], *, writing: bool = False) -> T | None:
        """The command's reply, or None when it failed: the pool busy (counted where it happened), or a Redis
        error (noted in its health; `writing`: an OOM reply pauses writes)."""
        try:
            return await command
        except PoolTimeout:
            return None
        except RedisError as exc:
            self.health.on_error(exc, writing=writing)
            return None

    def _on_subscriber_lost(self, exc: Exception) -> None:
        if isinstance(exc, UNREACHABLE):
            self.health.on_error(exc)


async def maybe_in_thread(nbytes: int, fn, *args):
    """`fn(*args)`, in a worker thread for values of `_THREAD_BYTES` or more (hashing them would hold the loop)."""
    if nbytes >= _THREAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
