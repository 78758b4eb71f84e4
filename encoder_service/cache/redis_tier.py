"""Shared Redis tier: best effort, never on the response path, never a wrong answer.

  - Writes are write-behind: `write_behind` queues the entry (bounded in bytes; over the bound the write
    is dropped and counted) and one writer task serializes it (in a thread) and SETs it with a TTL backstop.
  - Reads: `get` fetches and verifies a whole value; `read_rows` reads only a chunk's rows with GETRANGE;
    `header` reads only the fixed header (row count, width, grid) and the value's length.
    Range scheme (see entry.py): the header is read once per key (GETRANGE of HEADER_LEN bytes) and kept in
    a small cache; each range read is then ONE MULTI/EXEC round trip of [header, STRLEN, the blocks covering
    the rows, the trailer]. MULTI makes the four replies one snapshot of the value, and the header re-read
    must equal the cached one, so a value evicted and rewritten in between (possibly with other bytes, e.g.
    by a replica on another GPU) is detected and re-read, not mixed.
  - Faults: a connection error or socket timeout marks the tier down (logged once, counted); while down every
    operation returns a miss at once and a background probe PINGs with exponential backoff, marking it up
    again (logged once). An OOM reply to a write (maxmemory reached and no eviction policy) pauses writes for
    a cool-down (logged once); reads go on. Short, corrupt or foreign values are counted and read as misses.
redis-py's own retries are off (`Retry(NoBackoff(), 0)`): retrying inside a request would stall it, and
recovery is the probe's job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import redis.asyncio as aioredis
import torch
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from encoder_service.cache.entry import HEADER_LEN, CorruptEntry, Entry, EntryHeader, rows_from_blocks

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
        probe_min_s: float = 0.5,
        probe_max_s: float = 30.0,
        oom_cooldown_s: float = 30.0,
        header_cache_size: int = 4096,
        max_connections: int = 64,
    ):
        self.url = url
        self.ttl_s = ttl_s
        self.max_queued_bytes = max_queued_bytes
        self.probe_min_s, self.probe_max_s = probe_min_s, probe_max_s
        self.oom_cooldown_s = oom_cooldown_s
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            max_connections=max_connections,
        )
        self.up = True
        self._writes_paused_until = 0.0  # monotonic; set by an OOM reply
        self._queue: asyncio.Queue[tuple[str, Entry]] = asyncio.Queue()
        self._queued_bytes = 0
        self._writer: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None
        self._headers: OrderedDict[str, tuple[EntryHeader, bytes]] = OrderedDict()
        self._header_cache_size = header_cache_size
        self.counters = dict(
            hits=0, misses=0, range_hits=0, header_hits=0, corrupt=0, errors=0, down_events=0, oom_events=0,
            writes=0, writes_dropped=0, skipped_down=0,
        )  # fmt: skip

    async def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="redis-tier-writer")
        try:
            await self._client.ping()
        except _UNREACHABLE as exc:
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
        await self._client.aclose()

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
        except RedisError as exc:
            self._on_error(exc)
        return None

    async def _get(self, key: str) -> Entry | None:
        data = await self._client.get(key)
        if data is None:
            self.counters["misses"] += 1
            return None
        entry = await _maybe_in_thread(len(data), Entry.from_bytes, data, key)
        self.counters["hits"] += 1
        return entry

    async def _read_rows(self, key: str, start: int, end: int) -> torch.Tensor | None:
        for _ in range(2):  # a second try only when the value changed under a cached header
            cached = self._headers.get(key) or await self._read_header(key)
            if cached is None:
                self.counters["misses"] += 1
                return None
            header, raw_header = cached
            header.check_rows(start, end)
            lo, hi = header.block_bytes_range(*header.block_span(start, end))
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.getrange(key, 0, HEADER_LEN - 1)
                pipe.strlen(key)
                pipe.getrange(key, lo, hi - 1)
                pipe.getrange(key, header.trailer_offset, header.total_len - 1)
                now_header, strlen, blocks, trailer = await pipe.execute()
            if now_header == raw_header:
                break
            self._headers.pop(key, None)  # evicted or rewritten since the header was cached
        else:
            raise CorruptEntry("value changed twice during a range read")
        if strlen != header.total_len:
            raise CorruptEntry(f"value is {strlen} bytes, the header says {header.total_len}")
        rows = await _maybe_in_thread(len(blocks), rows_from_blocks, header, trailer, start, end, blocks)
        self.counters["range_hits"] += 1
        return rows

    async def _header(self, key: str) -> EntryHeader | None:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.getrange(key, 0, HEADER_LEN - 1)
            pipe.strlen(key)
            raw, strlen = await pipe.execute()
        if not raw:
            self.counters["misses"] += 1
            return None
        header = self._cache_header(key, raw)
        if strlen != header.total_len:
            raise CorruptEntry(f"value is {strlen} bytes, the header says {header.total_len}")
        self.counters["header_hits"] += 1
        return header

    async def _read_header(self, key: str) -> tuple[EntryHeader, bytes] | None:
        raw = await self._client.getrange(key, 0, HEADER_LEN - 1)
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
        """Queue a write; never blocks. False (counted) when down, paused by OOM, or the queue is full."""
        if not self.up or time.monotonic() < self._writes_paused_until:
            self.counters["writes_dropped"] += 1
            return False
        if self._queued_bytes + entry.nbytes > self.max_queued_bytes:
            self.counters["writes_dropped"] += 1
            return False
        self._queued_bytes += entry.nbytes
        self._queue.put_nowait((key, entry))
        return True

    async def flush(self) -> None:
        """Wait until queued writes are done (tests, shutdown)."""
        await self._queue.join()

    async def _write_loop(self) -> None:
        while True:
            key, entry = await self._queue.get()
            try:
                await self._write(key, entry)
            except Exception:  # a bug here must not kill the writer silently: log it, keep writing
                self.counters["writes_dropped"] += 1
                log.exception("redis tier: write of %s failed", key)
            finally:
                self._queued_bytes -= entry.nbytes
                self._queue.task_done()

    async def _write(self, key: str, entry: Entry) -> None:
        if not self.up or time.monotonic() < self._writes_paused_until:
            self.counters["writes_dropped"] += 1
            return
        value = await asyncio.to_thread(entry.to_bytes, key)
        try:
            await self._client.set(key, value, px=int(self.ttl_s * 1000))
        except RedisError as exc:
            self.counters["writes_dropped"] += 1
            self._on_error(exc)
            return
        self._headers.pop(key, None)
        self.counters["writes"] += 1
        if self._writes_paused_until:
            self._writes_paused_until = 0.0
            log.warning("redis tier: writes succeed again after the OOM pause")

    # ---- state ----------------------------------------------------------------------------------

    def _available(self) -> bool:
        if not self.up:
            self.counters["skipped_down"] += 1
        return self.up

    def _on_error(self, exc: Exception) -> None:
        self.counters["errors"] += 1
        if isinstance(exc, OutOfMemoryError):
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

    def _mark_down(self, exc: Exception) -> None:
        if not self.up:
            return
        self.up = False
        self.counters["down_events"] += 1
        self._headers.clear()
        log.warning("redis tier unavailable (%r): serving from the local tier, probing %s", exc, self.url)
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="redis-tier-probe")

    async def _probe_loop(self) -> None:
        delay = self.probe_min_s
        while True:
            await asyncio.sleep(delay)
            try:
                await self._client.ping()
            except _UNREACHABLE:
                delay = min(delay * 2, self.probe_max_s)
                continue
            except RedisError as exc:  # answering, if oddly (e.g. LOADING): try again later
                log.debug("redis probe: %r", exc)
                delay = min(delay * 2, self.probe_max_s)
                continue
            self.up = True
            log.warning("redis tier reachable again at %s: reads and writes resume", self.url)
            return

    def stats(self) -> dict:
        return dict(
            self.counters,
            state="up" if self.up else "down",
            writes_paused=time.monotonic() < self._writes_paused_until,
            queued_bytes=self._queued_bytes,
        )


async def _maybe_in_thread(nbytes: int, fn, *args):
    if nbytes >= _THREAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
