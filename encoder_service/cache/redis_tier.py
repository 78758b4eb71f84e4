"""Shared Redis tier: best effort, never a wrong answer, never a stalled request.

  - Writes are write-behind: `write_behind` queues the entry (bounded in bytes; over the bound the write
    is dropped and counted) and one writer task serializes it (in a thread) and SETs it with a TTL backstop.
  - Reads: `get` fetches and verifies a whole value; `read_rows` reads only a chunk's rows with GETRANGE;
    `header` reads only the fixed header (row count, width, grid) and the value's length.
    Range scheme (see entry.py): the header is read once per key (GETRANGE of HEADER_LEN bytes) and kept in
    a small cache; each range read is then ONE pipelined round trip of [header, STRLEN, the blocks covering
    the rows, the trailer]. Not a MULTI/EXEC: Redis over maxmemory with `noeviction` refuses every MULTI,
    even of reads, while plain GETRANGEs still work. Another client's SET may land between the pipeline's
    commands, and the checks catch that: the header read in the pipeline must equal the cached one (its
    digest covers the trailer's digest), the trailer must match that digest and every block its checksum,
    so bytes of another value are never served. A mismatch is re-read once with a fresh header (the value
    was replaced meanwhile, e.g. by a replica on another GPU); a second one is a corrupt value.
  - Handoff (handoff.py): `mark_pending` at accept, the writer settles the marker and publishes when the
    rows land or cannot, `mark_failed` when the encode fails; `wait_for` is a fetch's wait on another
    replica, woken through one shared pub/sub connection (subscriber.py). `touch` finds which of a
    replica's local hits Redis evicted meanwhile (and keeps the others hot there).
  - Connections (redis_connections.py): bounded; more operations than connections wait for one, and
    running out is never "Redis is down"; a connection error is retried once on a fresh connection.
  - Faults: a connection error (again on the retry) or a socket timeout marks the tier down (logged once,
    counted); while down every operation returns a miss at once and a background probe PINGs with
    exponential backoff capped at `probe_max_s` (so Redis is back in use within one probe interval of
    answering again), closes the pooled connections from before the outage, and marks it up (logged once).
    An OOM reply to a write (maxmemory reached and no eviction policy) pauses writes for a cool-down (logged
    once); a failed read never does. Short, corrupt or foreign values are counted and read as misses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from encoder_service.cache import handoff
from encoder_service.cache.entry import HEADER_LEN, CorruptEntry, Entry, EntryHeader, rows_from_blocks
from encoder_service.cache.handoff import LANDED, EncodeFailed, Settled, is_pending, marker_name, pending_value
from encoder_service.cache.redis_connections import Connections, PoolTimeout, timeout_at
from encoder_service.cache.subscriber import Subscriber, SubscriberLost

log = logging.getLogger("encoder_service.cache.redis")

# Verify (hash) values larger than this in a worker thread so the event loop keeps serving.
_THREAD_BYTES = 1 << 20
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class RedisTier:
    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 86400,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        max_queued_bytes: int = 512 << 20,
        max_queued_notices: int = 4096,
        probe_min_s: float = 0.25,
        probe_max_s: float = 1.0,
        oom_cooldown_s: float = 30.0,
        header_cache_size: int = 4096,
        max_connections: int = 64,
        pool_wait_s: float = 2.0,
        failure_ttl_s: float = 60.0,
        max_marked: int = 65536,
    ):
        self.url = url
        self.ttl_s = ttl_s
        self.max_queued_bytes, self.max_queued_notices = max_queued_bytes, max_queued_notices
        self.probe_min_s, self.probe_max_s = probe_min_s, probe_max_s
        self.oom_cooldown_s = oom_cooldown_s
        self.failure_ttl_s = failure_ttl_s
        self._conns = Connections(
            url, max_connections=max_connections, wait_s=pool_wait_s, socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )  # fmt: skip
        self._subscriber = Subscriber(self._conns.pubsub_connection, self._on_subscriber_lost)
        self.up = True
        self._writes_paused_until = 0.0  # monotonic; set by an OOM reply to a write
        # Rows to write ("rows", key, Entry) and marker outcomes to publish ("settle", key, value), in order.
        self._queue: asyncio.Queue[tuple[str, str, object]] = asyncio.Queue()
        self._queued_bytes = 0
        self._writing: Counter[str] = Counter()  # keys of the queued row writes
        self._queued_notices = 0
        self._writer: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None
        self._headers: OrderedDict[str, tuple[EntryHeader, bytes]] = OrderedDict()
        self._header_cache_size = header_cache_size
        self._marked: OrderedDict[str, None] = OrderedDict()  # ids marked pending here, not settled yet
        self._max_marked = max_marked
        self.counters = dict(
            hits=0, misses=0, range_hits=0, header_hits=0, corrupt=0, errors=0, down_events=0, oom_events=0,
            writes=0, writes_dropped=0, skipped_down=0, notices_dropped=0,
            pending_marked=0, pending_settled=0, pending_waits=0, pending_wakeups=0, pending_timeouts=0,
            pending_failures=0,
        )  # fmt: skip

    async def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="redis-tier-writer")
        try:
            await self._conns.run("ping")
        except (*_UNREACHABLE, PoolTimeout) as exc:
            self._mark_down(exc)

    async def close(self, drain_s: float = 2.0) -> None:
        """Give queued writes up to `drain_s` to land (they are only a cache), then stop."""
        if self.up and self._writer is not None and not self._writer.done():
            try:
                await asyncio.wait_for(self._queue.join(), timeout=drain_s)
            except asyncio.TimeoutError:
                log.warning("redis tier: %d queued bytes not written at shutdown", self._queued_bytes)
        for task in (self._writer, self._probe):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._writer, self._probe) if t is not None), return_exceptions=True)
        await self._subscriber.close()
        await self._conns.close()

    # ---- reads ----------------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        """Whole entry, verified; None on a miss, a corrupt value, or while Redis is down."""
        return await self._read(key, self._get)

    async def read_rows(self, key: str, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) read with GETRANGE, verified; None on a miss/corrupt/down.
        InvalidInput when the range is outside the stored entry."""
        return await self._read(key, self._read_rows, start, end)

    async def header(self, key: str) -> EntryHeader | None:
        """The entry's header alone (rows, width, grid, ...): one round trip of [GETRANGE of the header,
        STRLEN], verified (digest, key tag, length); None on a miss/corrupt/down. Cached for `read_rows`."""
        return await self._read(key, self._header)

    async def _read(self, key: str, read, *args):
        """`await read(key, *args)`; None while down, and a corrupt value or a Redis error (counted) is a miss."""
        if not self._available():
            return None
        try:
            return await read(key, *args)
        except CorruptEntry as exc:
            self._on_corrupt(key, exc)
        except PoolTimeout:
            pass  # counted where it happened
        except RedisError as exc:
            self._on_error(exc)
        return None

    async def _get(self, key: str) -> Entry | None:
        data = await self._conns.run("get", key)
        if data is None:
            self.counters["misses"] += 1
            return None
        entry = await _maybe_in_thread(len(data), Entry.from_bytes, data, key)
        self.counters["hits"] += 1
        return entry

    async def _read_rows(self, key: str, start: int, end: int) -> torch.Tensor | None:
        problem = ""
        for _ in range(2):  # a second try only when the value changed (or looked corrupt) during the first
            cached = self._headers.get(key) or await self._read_header(key)
            if cached is None:
                self.counters["misses"] += 1
                return None
            header, raw_header = cached
            header.check_rows(start, end)
            lo, hi = header.block_bytes_range(*header.block_span(start, end))
            now_header, strlen, blocks, trailer = await self._conns.pipelined(
                ("getrange", key, 0, HEADER_LEN - 1), ("strlen", key),
                ("getrange", key, lo, hi - 1), ("getrange", key, header.trailer_offset, header.total_len - 1),
            )  # fmt: skip
            if now_header != raw_header:
                problem = "value changed during a range read"  # evicted or rewritten since the header was cached
            elif strlen != header.total_len:
                problem = f"value is {strlen} bytes, the header says {header.total_len}"
            else:
                try:
                    rows = await _maybe_in_thread(len(blocks), rows_from_blocks, header, trailer, start, end, blocks)
                except CorruptEntry as exc:  # corrupt, or a SET landed between the pipeline's commands
                    problem = exc.message
                else:
                    self.counters["range_hits"] += 1
                    return rows
            self._headers.pop(key, None)
        raise CorruptEntry(f"{problem} (twice)")

    async def _header(self, key: str) -> EntryHeader | None:
        problem = ""
        for _ in range(2):  # a second try only when the length disagreed (a SET between the two commands?)
            raw, strlen = await self._conns.pipelined(("getrange", key, 0, HEADER_LEN - 1), ("strlen", key))
            if not raw:
                self.counters["misses"] += 1
                return None
            header = self._cache_header(key, raw)
            if strlen == header.total_len:
                self.counters["header_hits"] += 1
                return header
            problem = f"value is {strlen} bytes, the header says {header.total_len}"
            self._headers.pop(key, None)
        raise CorruptEntry(f"{problem} (twice)")

    async def _read_header(self, key: str) -> tuple[EntryHeader, bytes] | None:
        raw = await self._conns.run("getrange", key, 0, HEADER_LEN - 1)
        if not raw:
            return None
        return self._cache_header(key, raw), raw

    def _cache_header(self, key: str, raw: bytes) -> EntryHeader:
        header = EntryHeader.parse(raw, key)
        self._headers[key] = (header, raw)
        if len(self._headers) > self._header_cache_size:
            self._headers.popitem(last=False)
        return header

    # ---- writes ---------------------------------------------------------------------------------

    def write_behind(self, key: str, entry: Entry) -> bool:
        """Queue a write; never blocks. False (counted) when down, paused by OOM, or the queue is full; then
        an id marked pending here is settled as failed ("not stored"), so fetches elsewhere stop waiting."""
        if (why := self._not_writing()) is not None:
            self._dropped(key, why)
            return False
        if self._queued_bytes + entry.nbytes > self.max_queued_bytes:
            self._dropped(key, "the write-behind queue to Redis was full")
            return False
        self._queued_bytes += entry.nbytes
        self._writing[key] += 1
        self._queue.put_nowait(("rows", key, entry))
        return True

    async def flush(self) -> None:
        """Wait until queued writes and notices are done (tests, shutdown)."""
        await self._queue.join()

    async def _write_loop(self) -> None:
        while True:
            kind, key, item = await self._queue.get()
            try:
                if kind == "rows":
                    await self._write(key, item)
                else:
                    await self._settle(key, item)
            except Exception:  # a bug here must not kill the writer silently: log it, keep writing
                self.counters["writes_dropped" if kind == "rows" else "notices_dropped"] += 1
                log.exception("redis tier: %s of %s failed", "write" if kind == "rows" else "notice", key)
            finally:
                if kind == "rows":
                    self._queued_bytes -= item.nbytes
                    self._writing[key] -= 1
                    if not self._writing[key]:
                        del self._writing[key]
                else:
                    self._queued_notices -= 1
                self._queue.task_done()

    async def _write(self, key: str, entry: Entry) -> None:
        if (why := self._not_writing()) is not None:
            self._dropped(key, why)
            return
        value = await asyncio.to_thread(entry.to_bytes, key)
        try:
            await self._conns.run("set", key, value, px=int(self.ttl_s * 1000))
        except (RedisError, PoolTimeout) as exc:
            if isinstance(exc, RedisError):
                self._on_error(exc, writing=True)
            self._dropped(key, "Redis is full" if isinstance(exc, OutOfMemoryError) else "its write failed")
            return
        self._headers.pop(key, None)
        self.counters["writes"] += 1
        if self._writes_paused_until:
            self._writes_paused_until = 0.0
            log.warning("redis tier: writes succeed again after the OOM pause")
        # Every landed write wakes the fetches waiting for it, whichever replica marked it pending.
        await self._settle(key, LANDED)

    def _dropped(self, key: str, why: str) -> None:
        self.counters["writes_dropped"] += 1
        if key in self._marked:
            self._notify(key, handoff.failure_value(handoff.NOT_STORED, f"its rows were not stored: {why}"))

    # ---- handoff between replicas (handoff.py) --------------------------------------------------

    async def mark_pending(self, keys: Sequence[str], ttl_s: float, tags: Mapping[str, int] | None = None) -> bool:
        """Mark `keys` pending (accepted here, being encoded), for `ttl_s` (the encode's lease), so a fetch on
        another replica waits for them instead of answering 404; a key's marker carries its content tag from
        `tags`, if any (a caller id's bytes). Awaited before `encode` answers: one round trip for all keys.
        False (nothing marked) while down or paused by OOM (the rows could not be stored either: a fetch
        elsewhere then answers 404, as without markers), or on an error."""
        if not keys or self._not_writing() is not None:
            return False
        px = max(1, int(ttl_s * 1000))
        tags = tags or {}
        try:
            await self._conns.pipelined(*(("set", marker_name(k), pending_value(tags.get(k, 0)), px) for k in keys))
        except PoolTimeout:
            return False
        except RedisError as exc:
            self._on_error(exc, writing=True)
            return False
        for key in keys:
            self._marked[key] = None
            self._marked.move_to_end(key)
        while len(self._marked) > self._max_marked:  # their markers expire by themselves
            self._marked.popitem(last=False)
        self.counters["pending_marked"] += len(keys)
        return True

    async def content_tags(self, keys: Sequence[str]) -> dict[str, int]:
        """The content tag recorded in Redis for each of `keys` (caller ids): its entry's header, else its pending
        marker (another replica encoding it now); keys with neither, or none recorded, are left out. One round
        trip; {} while down or on an error (then nobody here can tell: the encode goes on)."""
        if not keys or not self._available():
            return {}
        try:
            replies = await self._conns.pipelined(*(cmd for k in keys for cmd in (
                ("getrange", k, 0, HEADER_LEN - 1), ("get", marker_name(k)))))
        except PoolTimeout:
            return {}
        except RedisError as exc:
            self._on_error(exc)
            return {}
        tags = {}
        for key, raw, marker in zip(keys, replies[::2], replies[1::2]):
            tag = 0
            if raw:
                try:
                    tag = EntryHeader.parse(raw, key).content_tag
                except CorruptEntry as exc:
                    self._on_corrupt(key, exc)
            tag = tag or handoff.pending_tag(marker)
            if tag:
                tags[key] = tag
        return tags

    async def touch(self, keys: Sequence[str]) -> list[str]:
        """Of `keys` (entries this replica has in its local tier and was asked for again), those Redis no longer
        has and this tier is not writing already. TOUCH also refreshes their LRU clock in Redis: a replica
        serving an id from its own tier sends Redis nothing else, so without it Redis would evict the ids most
        used here first. One round trip; [] (nothing to act on) while down or paused by OOM, or on an error."""
        if not keys or self._not_writing() is not None:
            return []
        try:
            found = await self._conns.pipelined(*(("touch", k) for k in keys))
        except PoolTimeout:
            return []
        except RedisError as exc:
            self._on_error(exc)
            return []
        return [k for k, n in zip(keys, found) if not n and k not in self._writing]

    def mark_failed(self, key: str, exc: BaseException) -> None:
        """The encode of `key` failed here: if it was marked pending here, publish the failure (queued), so
        fetches elsewhere answer this error instead of waiting or answering 404."""
        if key in self._marked:
            self._notify(key, handoff.failure_of(exc))

    def mark_landed(self, key: str) -> None:
        """`key` was marked pending here but its rows were in Redis already (another replica wrote them):
        clear the marker and wake its waiters (queued). Rows this tier writes settle by themselves."""
        if key in self._marked:
            self._notify(key, LANDED)

    async def wait_for(self, key: str, timeout_s: float | None, label: str | None = None) -> Settled:
        """A fetch's wait for `key` (a miss here) that another replica may be encoding. LANDED as soon as its
        rows are in Redis (read them now); NOT_PENDING at once when nobody marked it, or when its marker
        expires meanwhile; TIMED_OUT after `timeout_s` (None: bounded by the marker's TTL only; 0: the state
        now, without waiting: TIMED_OUT for an id still pending); UNAVAILABLE when Redis is or goes down (at
        once, no hang). Raises `EncodeFailed` with the encoding replica's error. `label` names the id in
        error messages (default: `key`)."""
        if not self._available():
            return Settled.UNAVAILABLE
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        try:
            async with timeout_at(deadline if timeout_s else None):  # 0: "don't wait", after one check
                return await self._wait(key, label or key, deadline)
        except TimeoutError:
            self.counters["pending_timeouts"] += 1
            return Settled.TIMED_OUT
        except EncodeFailed:
            self.counters["pending_failures"] += 1
            raise
        except (SubscriberLost, PoolTimeout):
            return Settled.UNAVAILABLE
        except RedisError as exc:
            self._on_error(exc)
            return Settled.UNAVAILABLE

    async def _wait(self, key: str, label: str, deadline: float | None) -> Settled:
        marker = marker_name(key)
        settled, _ = await self._check(key, marker, label)
        if settled is not None:
            return settled
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise TimeoutError  # pending, and no time left to wait
        async with self._subscriber.subscription(marker) as message:
            slept = False
            while True:
                # Subscribed (Redis confirmed it): check again. An outcome published between the first check
                # and the SUBSCRIBE is visible as state now (the publisher changes the state first); any
                # later one arrives as a message. The wait ends at the marker's expiry at the latest (its
                # replica crashed?): then the state is checked again, as the marker may have been renewed.
                settled, expires_at = await self._check(key, marker, label)
                if settled is not None:
                    return settled
                if not slept:
                    self.counters["pending_waits"] += 1
                    slept = True
                # Bounded by the caller's deadline here too, not only by the cancellation `wait_for`'s
                # timeout sends: on Python 3.11 asyncio.wait_for (inside redis-py) can swallow one.
                wake_at = min((t for t in (expires_at, deadline) if t is not None), default=None)
                try:
                    async with timeout_at(wake_at):
                        value = await asyncio.shield(message)
                    break
                except TimeoutError:
                    if wake_at == deadline:
                        raise
        if value is None:
            raise SubscriberLost("redis pub/sub connection lost during the wait")
        self.counters["pending_wakeups"] += 1
        handoff.raise_if_failed(value, label)
        return Settled.LANDED

    async def _check(self, key: str, marker: str, label: str) -> tuple[Settled | None, float | None]:
        """(LANDED or NOT_PENDING, None) or raises the failure; (None, when the marker expires, in loop time)
        while still pending."""
        exists, value, pttl = await self._conns.pipelined(("exists", key), ("get", marker), ("pttl", marker))
        if exists:
            return Settled.LANDED, None
        if is_pending(value):
            # Wake 20 ms past the expiry, so that the next check finds it gone; -1: no TTL (not one of ours).
            return None, asyncio.get_running_loop().time() + (pttl + 20) / 1000 if pttl >= 0 else None
        handoff.raise_if_failed(value, label)
        return Settled.NOT_PENDING, None

    def _notify(self, key: str, value: bytes) -> None:
        """Queue a marker outcome behind the queued writes (bounded in count; dropped while down: no Redis to
        tell, and the marker expires by itself)."""
        self._marked.pop(key, None)
        if not self.up or self._queued_notices >= self.max_queued_notices:
            self.counters["notices_dropped"] += 1
            return
        self._queued_notices += 1
        self._queue.put_nowait(("settle", key, value))

    async def _settle(self, key: str, value: bytes) -> None:
        """State first, then the message: a waiter subscribed before the PUBLISH gets the message, and one
        subscribed after it sees the new state when it checks again."""
        self._marked.pop(key, None)
        if not self.up:
            self.counters["notices_dropped"] += 1
            return
        marker = marker_name(key)
        try:
            if value == LANDED:
                await self._conns.pipelined(("delete", marker), ("publish", marker, value))
            else:
                try:
                    await self._conns.run("set", marker, value, px=int(self.failure_ttl_s * 1000))
                except OutOfMemoryError as exc:  # SET refused when full; DEL is not: nobody waits on "pending"
                    self._on_error(exc, writing=True)
                    await self._conns.run("delete", marker)
                await self._conns.run("publish", marker, value)
        except PoolTimeout:
            self.counters["notices_dropped"] += 1
            return
        except RedisError as exc:
            self.counters["notices_dropped"] += 1
            self._on_error(exc, writing=True)
            return
        self.counters["pending_settled"] += 1

    # ---- state ----------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """"up" or "down" (readiness detail, stats)."""
        return "up" if self.up else "down"

    def _available(self) -> bool:
        if not self.up:
            self.counters["skipped_down"] += 1
        return self.up

    def _writes_paused(self) -> bool:
        return time.monotonic() < self._writes_paused_until

    def _not_writing(self) -> str | None:
        """Why nothing is written to Redis now (down, or paused by an OOM reply), else None."""
        if not self.up:
            return "Redis is unreachable"
        return "Redis is full" if self._writes_paused() else None

    def _on_error(self, exc: Exception, *, writing: bool = False) -> None:
        self.counters["errors"] += 1
        if isinstance(exc, OutOfMemoryError):
            if not writing:  # a read refused when full (not ours: we never MULTI): no reason to pause writes
                log.debug("redis tier: read refused when full: %r", exc)
                return
            if not self._writes_paused_until:
                self.counters["oom_events"] += 1
                log.warning(
                    "redis tier is full (%s): writes paused for %.0f s, serving from the local tier; "
                    "set maxmemory-policy allkeys-lru on the server", exc, self.oom_cooldown_s,
                )  # fmt: skip
            self._writes_paused_until = time.monotonic() + self.oom_cooldown_s
        elif isinstance(exc, _UNREACHABLE):
            self._mark_down(exc)
        else:  # e.g. WRONGTYPE: someone stored another type under our key; a miss, not an outage
            log.debug("redis tier error: %r", exc)

    def _on_corrupt(self, key: str, exc: CorruptEntry) -> None:
        self.counters["corrupt"] += 1
        self._headers.pop(key, None)
        log.warning("redis tier: ignoring bad value at %s: %s", key, exc.message)

    def _on_subscriber_lost(self, exc: Exception) -> None:
        if isinstance(exc, _UNREACHABLE):
            self._on_error(exc)

    def _mark_down(self, exc: Exception) -> None:
        if not self.up:
            return
        self.up = False
        self.counters["down_events"] += 1
        self._headers.clear()
        self._subscriber.reset(exc)  # waiting fetches answer now instead of at their timeout
        log.warning("redis tier unavailable (%r): serving from the local tier, probing %s", exc, self.url)
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="redis-tier-probe")

    async def _probe_loop(self) -> None:
        delay = self.probe_min_s
        while True:
            await asyncio.sleep(delay)
            try:
                await self._conns.run("ping")
            except (*_UNREACHABLE, PoolTimeout):
                delay = min(delay * 2, self.probe_max_s)
                continue
            except RedisError as exc:  # answering, if oddly (e.g. LOADING): try again later
                log.debug("redis probe: %r", exc)
                delay = min(delay * 2, self.probe_max_s)
                continue
            # Connections pooled before the outage are dead if Redis restarted: close the idle ones, so the
            # first reads after recovery connect afresh instead of failing on them.
            await self._conns.close_idle()
            self.up = True
            log.warning("redis tier reachable again at %s: reads and writes resume", self.url)
            return

    def stats(self) -> dict:
        return dict(
            self.counters,
            **self._conns.counters,
            **self._subscriber.counters,
            state=self.state,
            writes_paused=self._writes_paused(),
            queued_bytes=self._queued_bytes,
            queued_notices=self._queued_notices,
            pending_channels=self._subscriber.channels,
            pending_unsettled=len(self._marked),
        )


async def _maybe_in_thread(nbytes: int, fn, *args):
    if nbytes >= _THREAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
