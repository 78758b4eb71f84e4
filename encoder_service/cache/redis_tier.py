"""Shared Redis tier: the directory of which replica holds which id's rows, the claims, bindings and image
bytes of the replicas (directory.py), and optional copies of small entries' rows. Best effort, never a wrong
answer, never a stalled request.

  - Writes are write-behind: `write_behind` queues an entry; one writer task SETs its location (this
    replica and the entry's header, with the TTL backstop) and, for an entry of at most `row_copy_bytes`,
    a copy of its rows first, then settles the id's claim. The queue is bounded (`max_queued_locations`,
    copies by `max_queued_bytes`: over it a copy is dropped, never the location); while Redis is
    unreachable what is queued waits, in order with the claims' outcomes, and is written once it is back.
  - Reads: `locate` reads where an id's rows are (one round trip, kept `replica_url_cache_s`), and the
    owner's advertised address; a row copy is read whole (`get`) or by range (`read_rows`: GETRANGE of the
    blocks covering the rows). Range scheme (entry.py): the copy's header is read once and cached; each
    range read is ONE pipelined round trip of [header, STRLEN, the blocks, the trailer], not a MULTI/EXEC
    (a full `noeviction` Redis refuses every MULTI, even of reads), checked end to end (the header equal to
    the cached one, the trailer's digest, every block's checksum): bytes of another value are never served.
  - Replicas (directory.py): `bind_tags` binds caller ids to one content (first come first served);
    `mark_pending` claims ids at accept (SET NX, the image bytes beside the marker); a heartbeat renews this
    replica's markers and its address until they settle (and writes them again after an outage); the
    writer settles a marker and publishes when the location lands or cannot, `mark_failed` when the
    encode fails or is given up; `wait_for` is a fetch's (or a waiting flight's) wait on another replica,
    woken through one shared pub/sub connection (subscriber.py). `touch` finds which of a replica's local
    hits Redis lost the location of (and keeps the others hot there).
  - Connections (redis_connections.py): bounded; more operations than connections wait for one, and running
    out is never "Redis is down"; a connection error is retried once on a fresh connection.
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
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import xxhash
from redis.exceptions import OutOfMemoryError, RedisError

from encoder_service.cache import bindings, directory
from encoder_service.cache.entry import HEADER_LEN, CorruptEntry, Entry, EntryHeader, rows_from_blocks
from encoder_service.cache.claims import Claim, Claims
from encoder_service.cache.directory import (
    LANDED, RELEASED, EncodeFailed, Located, Marked, Settled, input_name, is_pending, marker_name,
)  # fmt: skip
from encoder_service.cache.redis_connections import Connections, PoolTimeout, timeout, timeout_at
from encoder_service.cache.redis_health import UNREACHABLE, RedisHealth
from encoder_service.cache.subscriber import Subscriber, SubscriberLost
from encoder_service.errors import Unavailable

log = logging.getLogger("encoder_service.cache.redis")
T = TypeVar("T")

# Verify (hash) values larger than this in a worker thread so the event loop keeps serving.
_THREAD_BYTES = 1 << 20
CORRUPT_LOG_S = 10.0  # at most one line about bad values this often


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


class RedisTier:
    def __init__(self, url: str, options: RedisOptions | None = None, **overrides):
        o = dataclasses.replace(options or RedisOptions(), **overrides)
        self.options = o
        self.url = url
        self.ttl_s = o.ttl_s
        self._ttl_px = int(o.ttl_s * 1000)
        self.owner_url, self.row_copy_bytes = o.owner_url, o.row_copy_bytes
        self._pending_px = int(o.pending_ttl_s * 1000)
        self._conns = Connections(url, max_connections=o.max_connections, wait_s=o.pool_wait_s,
                                  socket_timeout_s=o.socket_timeout_s, connect_timeout_s=o.connect_timeout_s)
        # This replica's claims; the owner in their markers names this process (its replica, this run).
        self._claims = Claims(self._conns, uuid.uuid4().hex[:12], pending_ttl_s=o.pending_ttl_s,
                              max_claims=o.max_marked, max_input_bytes=o.max_input_bytes)
        self.owner = self._claims.owner
        self._subscriber = Subscriber(self._conns.pubsub_route, self._on_subscriber_lost)
        # Directory reads kept for `replica_url_cache_s`: owner -> (its URL, read at); key -> (Located, read at)
        self._replica_urls: dict[str, tuple[str | None, float]] = {}
        self._locations: OrderedDict[str, tuple[Located, float]] = OrderedDict()
        # Rows to write ("rows", key, Entry, epoch) and marker outcomes to publish ("settle", key, (value, claim),
        # epoch), with the epoch they were queued in.
        self._queue: asyncio.Queue[tuple[str, str, object, int]] = asyncio.Queue()
        self._queued_bytes = 0  # of the queued row copies
        self._queued_locations = 0
        self._writing: Counter[str] = Counter()  # keys of the queued row writes
        self._queued_notices = 0
        self._tasks: dict[str, asyncio.Task] = {}  # writer, heartbeat
        # Row copies' headers read, with the health generation they were read in (one from before an outage
        # is not trusted after it).
        self._headers: OrderedDict[str, tuple[EntryHeader, bytes, int]] = OrderedDict()
        self._corrupt_logged_at, self._corrupt_logged = -CORRUPT_LOG_S, 0  # the last line about bad values
        self._told_shared_url = False  # another replica advertises this one's address (logged once)
        self.counters = dict(
            hits=0, misses=0, range_hits=0, header_hits=0, corrupt=0, errors=0, down_events=0, oom_events=0,
            writes=0, writes_dropped=0, writes_dropped_full=0, writes_after_outage=0, skipped_down=0,
            located=0, copies=0, copies_dropped=0, copies_dropped_full=0,
            notices_dropped=0, bindings_checked=0, restarts_seen=0, pending_marked=0, pending_elsewhere=0,
            pending_settled=0, pending_waits=0,
            pending_wakeups=0, pending_timeouts=0, pending_failures=0, pending_orphaned=0,
        )  # fmt: skip
        self.health = RedisHealth(self._conns, self._subscriber, self._conns.target.shown, self.counters,
                                  probe_min_s=o.probe_min_s,
                                  probe_max_s=o.probe_max_s, recovery_grace_s=o.recovery_grace_s,
                                  oom_pause_min_s=o.oom_pause_min_s, oom_pause_max_s=o.oom_pause_max_s)

    async def start(self) -> None:
        self.health.start()
        self._tasks["writer"] = asyncio.create_task(self._write_loop(), name="redis-tier-writer")
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
                await asyncio.wait_for(self._queue.join(), timeout=drain_s)
            except asyncio.TimeoutError:
                log.warning("redis tier: %d queued bytes not written at shutdown", self._queued_bytes)
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.health.close()
        if self.health.up:  # gone: peers stop asking it at once, and waiters take its claims over
            names = [marker_name(k) for k in self._claims]
            try:
                await self._conns.pipelined(("delete", directory.replica_name(self.owner)),
                                            *(cmd for m in names for cmd in (("delete", m), ("publish", m, RELEASED))))
            except (RedisError, PoolTimeout) as exc:  # they expire within pending_ttl_s anyway
                log.debug("redis tier: releasing %d claims at shutdown failed: %r", len(names), exc)
        await self._subscriber.close()
        await self._conns.close()

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

    # ---- reads ----------------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        """The whole row copy, verified; None on a miss, a corrupt value, or while Redis is down."""
        return await self._read(key, self._get)

    async def read_rows(self, key: str, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) of the row copy, read with GETRANGE, verified; None on a miss or a corrupt value.
        InvalidInput when the range is outside the stored entry; Unavailable while Redis is down or lost
        during the read (the id may well exist: a 503 the clients retry, never a 404)."""
        return await self._read(key, self._read_rows, start, end, strict=True)

    async def header(self, key: str) -> EntryHeader | None:
        """The row copy's header alone (rows, width, grid, ...): one round trip of [GETRANGE of the header,
        STRLEN], verified (digest, key tag, length); None on a miss/corrupt/down. Cached for `read_rows`."""
        return await self._read(key, self._header)

    async def locate(self, key: str, *, strict: bool = True) -> Located | None:
        """Where `key`'s rows are (directory.py: the replica that holds them and their header, and whether a
        row copy is in Redis), in one round trip of [GET location, GETRANGE copy header, STRLEN copy], plus
        one for the owner's address when not looked up within `replica_url_cache_s`. None when neither is
        there (a miss, or a corrupt value). `strict`: Unavailable while Redis is down or lost meanwhile, else
        None then."""
        return await self._read(key, self._locate, strict=strict)

    async def input(self, key: str) -> bytes | None:
        """The image bytes kept beside `key`'s marker by the replica that accepted it (directory.py); None when
        there are none (not kept, settled, expired) or while down."""
        return await self._read(key, self._input)

    async def _read(self, key: str, read, *args, strict: bool = False):
        """`await read(key, *args)`; a corrupt value or an error reply (counted) is a miss. Redis unreachable
        (down, lost during the read, no connection free in time): None, or Unavailable when `strict` (a read
        whose None would be a 404)."""
        if self.health.available():
            try:
                return await read(key, *args)
            except CorruptEntry as exc:
                self._on_corrupt(key, exc)
                return None
            except PoolTimeout:
                pass  # counted where it happened
            except RedisError as exc:
                self.health.on_error(exc)
                if not isinstance(exc, UNREACHABLE):
                    return None
        if strict:
            raise Unavailable("the shared Redis tier, where other replicas' ids are found, is unreachable: retry")
        return None

    async def _locate(self, key: str) -> Located | None:
        """Kept for `replica_url_cache_s` once found (a fetch sizes its ids, then reads their rows: one
        directory read), until a fetch finds it wrong (`forget_location`)."""
        cached = self._locations.get(key)
        if cached is not None and time.monotonic() - cached[1] < self.options.replica_url_cache_s:
            return cached[0]
        located = await self._read_location(key)
        if located is not None:
            self._locations[key] = (located, time.monotonic())
            self._locations.move_to_end(key)
            if len(self._locations) > self.options.header_cache_size:
                self._locations.popitem(last=False)
        return located

    async def _read_location(self, key: str) -> Located | None:
        location, raw, strlen = await self._conns.pipelined(
            ("get", directory.location_name(key)), ("getrange", key, 0, HEADER_LEN - 1), ("strlen", key))
        copy = None
        if raw:
            try:
                copy = EntryHeader.parse(raw, key)
                if strlen != copy.total_len:
                    raise CorruptEntry(f"value is {strlen} bytes, the header says {copy.total_len}")
            except CorruptEntry as exc:  # a bad copy is no copy: the location may still be good
                self._on_corrupt(key, exc)
                copy = None
        parsed = directory.parse_location(location)
        if parsed is None:
            if copy is None:
                self.counters["misses"] += 1
                return None
            self.counters["located"] += 1
            return Located(copy, "", None, True)
        owner, header, block_sums = parsed[0], EntryHeader.parse(parsed[1], key), parsed[2]
        if block_sums and (len(block_sums) != 8 * header.num_blocks
                           or xxhash.xxh3_64_intdigest(block_sums) != header.payload_digest):
            raise CorruptEntry("the location's block checksums do not match its header")
        self.counters["located"] += 1
        return Located(header, owner, await self._replica_url(owner), copy is not None, block_sums)

    async def _replica_url(self, owner: str) -> str | None:
        """The advertised URL of a live replica (its heartbeat renews it); None when it is gone, or it is this
        one: this owner, or one advertising this replica's own address (two replicas given one URL, or the
        Service's: asking it would ask this replica, which does not hold the rows). Looked up at most every
        `replica_url_cache_s` per owner: within that a replica that died is still asked, and the fetch that
        finds it gone takes the image over."""
        if owner == self.owner:
            return None
        now = time.monotonic()
        cached = self._replica_urls.get(owner)
        if cached is not None and now - cached[1] < self.options.replica_url_cache_s:
            return cached[0]
        value = await self._conns.run("get", directory.replica_name(owner))
        url = value.decode("utf-8", "replace") if value else None
        if url is not None and url == self.owner_url:
            if not self._told_shared_url:
                self._told_shared_url = True
                log.warning("replica %s advertises this replica's own address %s: its rows are never fetched "
                            "from there (each replica must advertise an address of its own: --advertise-url)",
                            owner, url)
            url = None
        if len(self._replica_urls) >= 1024:
            self._replica_urls.clear()
        self._replica_urls[owner] = (url, now)
        return url

    async def _get(self, key: str) -> Entry | None:
        data = await self._conns.run("get", key)
        if data is None:
            self.counters["misses"] += 1
            return None
        entry = await _maybe_in_thread(len(data), Entry.from_bytes, data, key)
        self.counters["hits"] += 1
        return entry

    async def _input(self, key: str) -> bytes | None:
        return await self._conns.run("get", input_name(key)) or None

    async def _read_rows(self, key: str, start: int, end: int) -> torch.Tensor | None:
        problem = ""
        for _ in range(2):  # a second try only when the value changed (or looked corrupt) during the first
            cached = self._headers.get(key)
            if cached is None or cached[2] != self.health.generation:  # none, or read before an outage
                cached = await self._read_header(key)
            if cached is None:
                self.counters["misses"] += 1
                return None
            header, raw_header = cached[:2]
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
        self._headers[key] = (header, raw, self.health.generation)
        if len(self._headers) > self.options.header_cache_size:
            self._headers.popitem(last=False)
        return header

    # ---- writes ---------------------------------------------------------------------------------

    def write_behind(self, key: str, entry: Entry) -> bool:
        """Queue the rows' location (this replica holds them: directory.py) and, for an entry of at most
        `row_copy_bytes`, a copy of the rows; never blocks. Queued also while Redis is down (written once it
        is back). A copy is dropped (counted) while writes are paused by OOM or when the backlog of copies is
        full: the location is written all the same. False (counted) only when the queue of locations is full;
        then an id claimed here is settled as failed ("not stored"), so waiters elsewhere stop waiting."""
        if self._queued_locations >= self.options.max_queued_locations:
            self._dropped(key, "the write-behind queue to Redis was full", "writes_dropped_full")
            return False
        copy = 0 < entry.nbytes <= self.row_copy_bytes
        if copy and self.health.writes_paused():
            self.counters["copies_dropped"] += 1
            copy = False
        if copy and self._queued_bytes + entry.nbytes > self.options.max_queued_bytes:
            self.counters["copies_dropped_full"] += 1
            copy = False
        self._queued_bytes += entry.nbytes if copy else 0
        self._queued_locations += 1
        self._writing[key] += 1
        self._queue.put_nowait(("rows", key, (entry, copy), self.health.epoch))
        return True

    def forget_location(self, key: str, owner: str) -> None:
        """A fetch found that `owner` does not give `key`'s rows (gone, or lost them): look both up afresh."""
        self._replica_urls.pop(owner, None)
        self._locations.pop(key, None)

    async def flush(self) -> None:
        """Wait until queued writes and notices are done (tests, shutdown)."""
        await self._queue.join()

    async def _write_loop(self) -> None:
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
                    self._queued_bytes -= item[0].nbytes if item[1] else 0
                    self._queued_locations -= 1
                    self._writing[key] -= 1
                    if not self._writing[key]:
                        del self._writing[key]
                else:
                    self._queued_notices -= 1
                self._queue.task_done()

    async def _write(self, key: str, entry: Entry, copy: bool, epoch: int) -> bool:
        """SET the rows' copy (when `copy`), then their location, then settle the marker (all queued in
        `epoch`). False when Redis went away meanwhile (try again once it is back); True when done: written,
        or dropped (OOM, an error reply). A copy Redis refuses is dropped alone; a location it refuses
        fails the id ("not stored": no replica could find its rows)."""
        if copy and not self.health.writes_paused():
            value = await asyncio.to_thread(entry.to_bytes, key)
            written = await self._write_command(("set", key, value, self._ttl_px), "copies_dropped")
            if written is None:
                return False
            self.counters["copies"] += written is True
            self._headers.pop(key, None)
        header = await _maybe_in_thread(entry.nbytes, entry.stored_header, key)  # one pass over the rows
        location = directory.location_value(self.owner, header.pack(), entry.block_sums())
        written = await self._write_command(("set", directory.location_name(key), location, self._ttl_px))
        if written is None:
            return False
        if written is not True:
            self._dropped(key, "Redis is full" if isinstance(written, OutOfMemoryError) else "its write failed")
            return True
        self._locations.pop(key, None)
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

    # ---- handoff between replicas (directory.py) --------------------------------------------------

    async def mark_pending(self, keys: Sequence[str], lease_s: float, tags: Mapping[str, int] | None = None,
                           inputs: Mapping[str, bytes] | None = None) -> Marked:
        """Claim `keys` (accepted here, to be encoded here) for at most `lease_s` (the encode's lease): SET NX
        of each marker, carrying its content tag from `tags` (a caller id's bytes), with the image bytes
        from `inputs` beside it (claims.py: bounded). One round trip; a second for markers found set
        (another replica's: it encodes that id, `Marked.elsewhere`; a failure or an old one of ours:
        replaced). The heartbeat renews the claims until they settle. Not `ok` while down or paused by OOM,
        or on an error: the claims are kept and their markers written once Redis takes them again."""
        async with self._claims.lock:  # a beat must not write one of these claims before its NX here
            claims = self._claims.add(keys, lease_s, tags or {}, inputs or {})
            if not claims or self.health.not_writing() is not None:
                return Marked(False)
            elsewhere = await self._or_none(self._claims.write(claims, lease_s, self.health.epoch), writing=True)
            if elsewhere is None:
                return Marked(False)
        self.counters["pending_marked"] += len(claims) - len(elsewhere)
        self.counters["pending_elsewhere"] += len(elsewhere)
        return Marked(True, frozenset(elsewhere))

    async def bind_tags(self, tags: Mapping[str, int], *, again: bool = False) -> dict[str, int]:
        """Bind caller ids to one content each, first come first served across replicas (bindings.py: one
        script per id, which also reads the content tag the id's location or pending marker carries, where
        Redis lost the binding itself). Returns by name the tag each id is bound to now: this one, another
        replica's (a Conflict for the caller), or bindings.RETIRED. One round trip. {} while down or on an
        error: nobody here can tell, and the encode goes on as without Redis (the bindings of what it accepts
        are written again once Redis is back, `again`).
        Within `recovery_grace_s` of Redis coming back, or on a Redis node this replica has not seen yet (it
        restarted since the heartbeat last looked), the replicas holding ids may not have written their
        bindings again yet: an id Redis knows nothing of is not bound then (Unavailable: retry), unless
        `again` (this replica writing again the bindings of ids it holds)."""
        if not tags or not self.health.available():
            return {}
        known = self.health.known_nodes()
        commands = [bindings.bind_command(directory.binding_name(name), directory.location_name(name),
                                          marker_name(name), tag=tag, ttl_px=self._ttl_px, again=again,
                                          known_nodes=known)
                    for name, tag in tags.items()]
        replies = await self._or_none(self._conns.pipelined(*commands, raise_on_error=False))
        if replies is None:
            return {}
        bound = {}
        for name, reply in zip(tags, replies):
            if isinstance(reply, RedisError):  # e.g. OOM on the SET: that id stays unbound (can't tell)
                self.health.on_error(reply, writing=True)
                continue
            tag = bindings.parse_bound(reply)
            if tag is bindings.RECOVERING:
                self.health.wake.set()  # a node new to this replica: look at Redis now
                raise Unavailable("the shared Redis tier came back moments ago, and the replicas holding caller "
                                  "ids have not written them again yet: retry")
            bound[name] = tag
        self.counters["bindings_checked"] += len(tags)
        return bound

    async def withdraw(self, key: str, tag: int) -> None:
        """An encode of caller id `key` found the id's rows elsewhere of content `tag`, not its own: its claim
        and kept bytes go (claims.py: withdraw), and the id's binding names `tag`, the rows that exist (the
        binding it passed was made before Redis knew of them). Best effort: Redis faults are the tier's."""
        await self._or_none(self._claims.withdraw(key), writing=True)
        await self._or_none(self._conns.pipelined(
            ("set", directory.binding_name(key), directory.binding_value(tag), self._ttl_px)), writing=True)

    async def retire(self, names: Sequence[str]) -> None:
        """Retire caller ids that name two contents on two replicas (bindings.py: Redis lost everything about
        them while one replica held them, then another accepted other bytes under them): their bindings say
        so for `ttl_s` and their locations go, so that no replica serves either content under them once it
        drops its own (every holder does at its next binding check). One round trip; best effort."""
        commands = [cmd for name in names for cmd in (
            ("set", directory.binding_name(name), bindings.RETIRED_VALUE, self._ttl_px),
            ("delete", directory.location_name(name)))]
        if commands:
            await self._or_none(self._conns.pipelined(*commands), writing=True)

    async def touch(self, keys: Sequence[str]) -> list[str]:
        """Of `keys` (entries this replica has in its local tier and was asked for again), those whose location
        Redis no longer has and this tier is not writing already. TOUCH also refreshes their LRU clock in
        Redis: a replica serving an id from its own tier sends Redis nothing else, so without it Redis would
        evict the ids most used here first. One round trip; [] (nothing to act on) while down or paused by
        OOM, or on an error."""
        if not keys or self.health.not_writing() is not None:
            return []
        found = await self._or_none(self._conns.pipelined(*(("touch", directory.location_name(k), k) for k in keys)))
        if found is None:
            return []
        return [k for k, n in zip(keys, found) if not n and k not in self._writing]

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

    async def wait_for(self, key: str, timeout_s: float | None, label: str | None = None) -> Settled:
        """A wait for `key` (a miss here) that another replica may be encoding. LANDED as soon as its rows are
        in Redis (read them now); ORPHANED once its marker is gone (expired: its owner stopped renewing it;
        or released) while its input is still there (encode it here); NOT_PENDING at once when there is
        neither; TIMED_OUT after `timeout_s` (None: no bound; 0: the state now, without waiting: TIMED_OUT
        for an id still pending); UNAVAILABLE when Redis is or goes down, or came back within
        `recovery_grace_s` and has no marker for it (at once, no hang). Raises `EncodeFailed` with the
        encoding replica's error. `label` names the id in error messages (default: `key`)."""
        if not self.health.available():
            return Settled.UNAVAILABLE
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        try:
            async with timeout_at(deadline if timeout_s else None):  # 0: "don't wait", after one check
                settled = await self._wait(key, label or key, deadline)
        except TimeoutError:
            self.counters["pending_timeouts"] += 1
            return Settled.TIMED_OUT
        except EncodeFailed:
            self.counters["pending_failures"] += 1
            raise
        except (SubscriberLost, PoolTimeout):
            return Settled.UNAVAILABLE
        except RedisError as exc:
            self.health.on_error(exc)
            return Settled.UNAVAILABLE
        if settled is Settled.NOT_PENDING and await self._cannot_tell(key):
            return Settled.UNAVAILABLE  # its owner may not have written its marker (again) yet
        self._locations.pop(key, None)  # landed (or being taken over) since it was last read: read it afresh
        self.counters["pending_orphaned"] += settled is Settled.ORPHANED
        return settled

    async def _cannot_tell(self, key: str) -> bool:
        try:
            return await self.health.cannot_tell(key)
        except (RedisError, PoolTimeout):
            return True  # not a 404 either

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
                # later one arrives as a message. The wait ends at the marker's expiry at the latest: then
                # the state is checked again (a live owner has renewed the marker; a dead one has not).
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
        if value == RELEASED:  # its owner gave it up: whoever claims it first encodes it
            return Settled.ORPHANED
        directory.raise_if_failed(value, label)
        return Settled.LANDED

    async def _check(self, key: str, marker: str, label: str) -> tuple[Settled | None, float | None]:
        """(LANDED, ORPHANED or NOT_PENDING, None) or raises the failure; (None, when the marker expires, in
        loop time) while still pending. LANDED: a location or a row copy, and no claim (a claim beside a
        location is an encode again, its owner gone: the rows it lands are the ones to read)."""
        exists, value, pttl, input_len = await self._conns.pipelined(
            ("exists", directory.location_name(key), key), ("get", marker), ("pttl", marker),
            ("strlen", input_name(key)))
        if is_pending(value):  # claimed: even beside a location (of a replica gone: being encoded again)
            # Wake 20 ms past the expiry, so that the next check finds it gone; -1: no TTL (not one of ours).
            return None, asyncio.get_running_loop().time() + (pttl + 20) / 1000 if pttl >= 0 else None
        if exists:
            return Settled.LANDED, None
        directory.raise_if_failed(value, label)
        return (Settled.ORPHANED if input_len else Settled.NOT_PENDING), None

    def _notify(self, key: str, value: bytes, claim: Claim | None) -> None:
        """Queue a marker outcome behind the queued writes (bounded in count; over it the claim is dropped:
        no longer renewed, its marker expires and a waiter takes the image over). Its claim is renewed until
        the outcome is settled."""
        if self._queued_notices >= self.options.max_queued_notices:
            self.counters["notices_dropped"] += 1
            if claim is not None:
                self._claims.drop(key, claim)
            return
        self._queued_notices += 1
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
                await self._claims.beat(self.health.epoch, writable=self.health.not_writing() is None)
            except PoolTimeout:
                pass  # busy: the next beat, well within pending_ttl_s
            except RedisError as exc:
                self.health.on_error(exc, writing=True)
            except Exception:  # a bug here must not stop the heartbeat silently: log it, keep beating
                log.exception("redis tier: heartbeat failed")

    async def _look(self) -> None:
        """Redis's state (a restart is a recovery: health.py), its memory (the room image bytes may take:
        claims.py), and, where peers fetch its rows, this replica alive at its address."""
        memory = await self.health.check()
        self._claims.redis_memory(int(memory.get("maxmemory", 0)), int(memory.get("used_memory", 0)),
                                  evicts=memory.get("maxmemory_policy", "noeviction") != "noeviction")
        if self.owner_url is not None:
            await self._conns.run("set", directory.replica_name(self.owner), self.owner_url, px=self._pending_px)

    def _on_corrupt(self, key: str, exc: CorruptEntry) -> None:
        """Counted every time, logged at most every CORRUPT_LOG_S (a value rewritten while it is read, by
        another replica writing the same id again, reads as corrupt many times a second under load)."""
        self.counters["corrupt"] += 1
        self._headers.pop(key, None)
        now = time.monotonic()
        if now - self._corrupt_logged_at >= CORRUPT_LOG_S:
            unlogged = self.counters["corrupt"] - self._corrupt_logged
            log.warning("redis tier: ignoring bad value at %s: %s (%d bad values since the last such line; "
                        "encoder_cache_redis_corrupt_values_total counts them all)", key, exc.message, unlogged)
            self._corrupt_logged_at, self._corrupt_logged = now, self.counters["corrupt"]

    async def _or_none(self, command: Awaitable[T], *, writing: bool = False) -> T | None:
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

    def stats(self) -> dict:
        return dict(
            self.counters,
            **self._conns.counters,
            **self._subscriber.counters,
            state=self.state,
            writes_paused=self.health.writes_paused(),
            queued_bytes=self._queued_bytes,
            queued_notices=self._queued_notices,
            pending_channels=self._subscriber.channels,
            pending_unsettled=len(self._claims),
            input_bytes=self._claims.input_bytes,
            inputs_skipped=self._claims.inputs_skipped,
            inputs_pushed_out=self._claims.inputs_pushed_out,
            error_replies=dict(self.health.error_reasons),
            nodes={node: int(state == "up") for node, state in self.health.nodes.items()},
        )


async def _maybe_in_thread(nbytes: int, fn, *args):
    if nbytes >= _THREAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
