"""What the Redis tier knows of Redis's state: up or down, just back, paused by a full Redis, restarted.

    health = RedisHealth(conns, subscriber, url, counters, probe_min_s=0.25, probe_max_s=1.0, ...)
    health.start()                    at the tier's start, on its loop
    health.available()                up (a call made while down is counted, and skipped by the caller)
    health.recovering()               up again within `recovery_grace_s` (others may not have written theirs yet)
    await health.cannot_tell(key)     Redis may not know yet what others hold of `key` (recovering, a node new
                                      here, a primary down): "unavailable", not a 404
    health.known_nodes()              the nodes' run ids seen, for scripts to tell a new node (bindings.py)
    health.not_writing()              why nothing is written now (down, or an OOM pause), else None
    health.on_error(exc, writing=...) a failed command: unreachable -> down, an OOM reply to a write -> a pause
    health.wrote()                    a write succeeded (after a pause ended, its probe: the doubling ends)
    await health.check()              the heartbeat's look: a changed run id is a restart (a recovery); -> INFO memory
    await health.recovered()          returns at the next recovery
    health.epoch, health.generation   recoveries, and times down, so far
    health.wake                       set at a recovery: the heartbeat beats at once

Down: a connection error (again on the retry) or a socket timeout; logged once, counted, and every wait on
the shared pub/sub connection answers at once (subscriber.reset). A probe then PINGs with exponential backoff
capped at `probe_max_s`, closes the pooled connections from before the outage, and marks it up: the epoch
grows (claims are written again), the writes waiting for Redis go on, `recovered()` returns. A restart no
command saw (an idle replica) is seen by `check()`: Redis's run id changed. An OOM reply to a write pauses
writes for `oom_pause_min_s`, doubling with each OOM of the pause's probe (the first write after it) up to
`oom_pause_max_s`; writes refused during the pause (sent before it began) extend nothing; a read refused
when full pauses nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time

from redis.exceptions import ClusterDownError, OutOfMemoryError, ReadOnlyError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from encoder_service.replicas import background
from encoder_service.replicas.bindings import NO_NODE, NODE_RUN_ID
from encoder_service.replicas.redis_connections import Connections, PoolTimeout
from encoder_service.redis_url import CLUSTER, SENTINEL
from encoder_service.replicas.subscriber import Subscriber

log = logging.getLogger("encoder_service.replicas.redis")

# A lost connection, and what a failover answers meanwhile: a Cluster's slots without a master (CLUSTERDOWN),
# a Sentinel's old master demoted to a replica (READONLY). All mean "down until the probe finds every primary
# again", never a miss. Not TRYAGAIN: a slot moving between live masters (a resharding) is an error reply for
# the keys of that slot alone (redis-py retries it, then answers "TTL exhausted"), while every other slot serves.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError, ClusterDownError,
               ReadOnlyError)
ERROR_LOG_S = 10.0  # at most one line per kind of error reply this often


class RedisHealth:
    def __init__(self, conns: Connections, subscriber: Subscriber, url: str, counters: dict, *,
                 probe_min_s: float, probe_max_s: float, recovery_grace_s: float, oom_pause_min_s: float,
                 oom_pause_max_s: float):
        self._conns, self._subscriber, self.url, self.counters = conns, subscriber, url, counters
        self.probe_min_s, self.probe_max_s, self.recovery_grace_s = probe_min_s, probe_max_s, recovery_grace_s
        self.oom_pause_min_s, self.oom_pause_max_s = oom_pause_min_s, oom_pause_max_s
        self.up = True
        self.up_again = asyncio.Event()  # set while up: writes wait on it while Redis is away
        self.wake = asyncio.Event()  # set at a recovery: the heartbeat beats at once
        self.epoch = 0  # one more at each recovery: claims written before it are written again
        self.generation = 0  # one more each time it goes down: what was read before may be stale
        self._up_since: float | None = None  # time.monotonic() of the last recovery (None: never down)
        self._seen: frozenset[str] | None = None  # the primaries' run ids as last seen: a new one is a restart
        self.nodes: dict[str, str] = {}  # primary address -> "up" / "down", as last seen
        self.error_reasons: collections.Counter[str] = collections.Counter()  # error replies by their code
        self._error_logged_at: dict[str, float] = {}
        self._recovery: asyncio.Future | None = None  # resolved at the next recovery
        self.oom_pause_s = 0.0  # the current pause after an OOM reply, doubled by each one of its probes
        self.paused_until = 0.0  # monotonic; set by an OOM reply to a write
        self._probe: asyncio.Task | None = None

    def start(self) -> None:
        self.up_again.set()
        self._recovery = asyncio.get_running_loop().create_future()

    async def close(self) -> None:
        if self._probe is not None:
            await background.stop([self._probe])

    async def recovered(self) -> None:
        """Returns the next time Redis is up again after being down (or seen restarted)."""
        await asyncio.shield(self._recovery)

    @property
    def state(self) -> str:
        """"up"; "down"; or "failing_over": down, while a Cluster's other primaries or a master's Sentinels
        still answer (a failover is expected to end it) (readiness detail, stats)."""
        if self.up:
            return "up"
        if self._conns.kind in (CLUSTER, SENTINEL) and any(state == "up" for state in self.nodes.values()):
            return "failing_over"
        return "down"

    def available(self) -> bool:
        if not self.up:
            self.counters["skipped_down"] += 1
        return self.up

    def recovering(self) -> bool:
        return self._up_since is not None and time.monotonic() - self._up_since < self.recovery_grace_s

    def known_nodes(self) -> str:
        """What a script checks the Redis node it runs on against (bindings.py): the primaries' run ids seen
        by the last look, or NO_NODE while recovering (every node is new then); "" before the first look."""
        return NO_NODE if self.recovering() else ",".join(sorted(self._seen or ()))

    async def cannot_tell(self, key: str) -> bool:
        """Whether Redis may not know yet what the other replicas hold of `key`: this replica is recovering; the
        node holding `key` is new to it (restarted, or promoted by a failover, since the heartbeat last looked;
        the heartbeat then looks at once); or, in a Cluster or behind Sentinels, a primary is down (a replica
        that lost it is down meanwhile, and writes again what it accepted once it is back). Asked before
        answering "nobody has it" (404). Raises what Redis raised."""
        known = self.known_nodes()
        if known == NO_NODE:
            return True
        if known:
            (run_id,) = await self._conns.pipelined(NODE_RUN_ID.command((key,), ()))
            if run_id is None or run_id.decode() not in known:
                self.wake.set()
                return True
        if self._conns.kind in (CLUSTER, SENTINEL):
            states = await self._conns.ping_primaries()
            down = sorted(node for node, state in states.items() if state != "up")
            if down:
                self.mark_down(RedisConnectionError(f"primaries down: {', '.join(down)}"))
                return True
        return False

    def writes_paused(self) -> bool:
        return time.monotonic() < self.paused_until

    def not_writing(self) -> str | None:
        if not self.up:
            return "Redis is unreachable"
        return "Redis is full" if self.writes_paused() else None

    def on_error(self, exc: Exception, *, writing: bool = False) -> None:
        self.counters["errors"] += 1
        if isinstance(exc, OutOfMemoryError):
            if not writing:  # a read refused when full (not ours: we never MULTI): no reason to pause writes
                log.debug("redis tier: read refused when full: %r", exc)
            elif not self.writes_paused():  # a write sent before the pause: only its own probe extends it
                self._pause(exc)
        elif isinstance(exc, UNREACHABLE):
            self.mark_down(exc)
        else:  # an error reply (CROSSSLOT, NOSCRIPT, WRONGTYPE, ...): a miss or a dropped write, never silent
            reason = error_reason(exc)
            self.error_reasons[reason] += 1
            now = time.monotonic()
            if now - self._error_logged_at.get(reason, -ERROR_LOG_S) >= ERROR_LOG_S:
                self._error_logged_at[reason] = now
                log.error("redis tier: Redis answered an error (%s): %s (encoder_cache_redis_error_replies_total "
                          "counts them)", reason, exc)

    def _pause(self, exc: Exception) -> None:
        # Probe sooner than a fixed cool-down: the pause doubles with each OOM of its probe, from the minimum.
        self.oom_pause_s = min(self.oom_pause_max_s, 2 * self.oom_pause_s or self.oom_pause_min_s)
        if not self.paused_until:
            self.counters["oom_events"] += 1
            log.warning("redis tier is full (%s): writes paused (%.1f s, doubling while Redis stays full, up to "
                        "%.0f s), serving from the local tier; set maxmemory-policy allkeys-lru on the server",
                        exc, self.oom_pause_s, self.oom_pause_max_s)
        self.paused_until = time.monotonic() + self.oom_pause_s

    def wrote(self) -> None:
        if self.paused_until and not self.writes_paused():
            self.paused_until, self.oom_pause_s = 0.0, 0.0
            log.warning("redis tier: writes succeed again after the OOM pause")

    def mark_down(self, exc: Exception) -> None:
        if not self.up:
            return
        self.up = False
        self.nodes = dict.fromkeys(self.nodes, "down")  # until the probe looks at each one
        self.generation += 1
        self.up_again.clear()
        self.counters["down_events"] += 1
        self._subscriber.reset(exc)  # waiting fetches answer now instead of at their timeout
        log.warning("redis tier unavailable (%r): serving from the local tier, probing %s", exc, self.url)
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="redis-tier-probe")

    async def _probe_loop(self) -> None:
        delay = self.probe_min_s
        while True:
            await asyncio.sleep(delay)
            try:
                # The topology again (a failover moves a Cluster's slots, or a Sentinel's master), and closes
                # the connections from before the outage (after a restart they are dead), then every primary.
                await self._conns.refresh()
                self.nodes = await self._conns.ping_primaries()
            except (*UNREACHABLE, PoolTimeout) as exc:
                self.nodes = self._conns.nodes_down(exc)
                delay = min(delay * 2, self.probe_max_s)
                continue
            except RedisError as exc:  # answering, if oddly (e.g. LOADING, CLUSTERDOWN): try again later
                log.debug("redis probe: %r", exc)
                delay = min(delay * 2, self.probe_max_s)
                continue
            if not all(state == "up" for state in self.nodes.values()):
                delay = min(delay * 2, self.probe_max_s)
                continue
            self._recovered()
            log.warning("redis tier reachable again at %s: reads and writes resume", self.url)
            return

    def _recovered(self) -> None:
        self.up = True
        # The grace: the other replicas write again what Redis lost, or what they could not write meanwhile.
        self._up_since = time.monotonic()
        self.epoch += 1
        self.up_again.set()  # the writes waiting for Redis go on
        self.wake.set()  # claims are written again at once
        recovery, self._recovery = self._recovery, asyncio.get_running_loop().create_future()
        if recovery is not None and not recovery.done():
            recovery.set_result(None)

    async def check(self) -> dict:
        """Redis's memory (INFO memory of every primary, summed). A primary this replica has not seen before
        (its run id is new: it restarted between two commands of this replica, an idle one included, or a
        failover promoted a replica) may lack what the replicas wrote: taken as a recovery. Raises what Redis
        raised."""
        servers = await self._conns.on_primaries("INFO", "server")
        memory = await self._conns.on_primaries("INFO", "memory")
        new = [node for node, info in servers.items()
               if self._seen is not None and str(info.get("run_id")) not in self._seen]
        if new and not self.recovering():
            self.counters["restarts_seen"] += 1
            log.warning("redis tier: Redis primary %s at %s is new (restarted, or promoted by a failover): writing "
                        "this replica's claims, leased ids and bindings again", ", ".join(new), self.url)
            self._recovered()
        self._seen = frozenset(str(info.get("run_id")) for info in servers.values())
        self.nodes = dict.fromkeys(servers, "up")
        totals = {k: sum(int(m.get(k, 0)) for m in memory.values()) for k in ("maxmemory", "used_memory")}
        policies = {m.get("maxmemory_policy", "noeviction") for m in memory.values()}
        return dict(totals, maxmemory_policy="noeviction" if "noeviction" in policies else policies.pop())


def error_reason(exc: Exception) -> str:
    """An error reply's code (its first word when Redis gave one: CROSSSLOT, NOSCRIPT, WRONGTYPE, OOM, ...), else
    the exception's type."""
    word = str(exc).split(" ", 1)[0]
    return word if re.fullmatch(r"[A-Z]{3,20}", word) else type(exc).__name__
