"""The Redis tier's reads (redis_tier.py): where an id's rows are (the directory: `locate`, one round trip, kept
`replica_url_cache_s`, with the owner's advertised address), a row copy whole (`get`) or by range
(`read_rows`: GETRANGE of the blocks covering the rows), its header alone (`header`), an accepted image's
kept bytes (`input`). Range scheme (entry.py): the copy's header is read once and cached; each range read is
ONE pipelined round trip of [header, STRLEN, the blocks, the trailer], not a MULTI/EXEC (a full `noeviction`
Redis refuses every MULTI, even of reads), checked end to end (the header equal to the cached one, the
trailer's digest, every block's checksum): bytes of another value are never served. Short, corrupt or
foreign values are counted (and logged rarely) and read as misses; while Redis is unreachable a read
answers at once (a miss, or Unavailable where a miss would be a 404)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
import xxhash
from redis.exceptions import RedisError

from encoder_service.cache.entry import HEADER_LEN, CorruptEntry, Entry, EntryHeader, rows_from_blocks
from encoder_service.errors import Unavailable
from encoder_service.replicas import directory
from encoder_service.replicas.directory import Located, input_name
from encoder_service.replicas.redis_connections import PoolTimeout
from encoder_service.replicas.redis_health import UNREACHABLE
from encoder_service.replicas.redis_link import RedisLink, maybe_in_thread

log = logging.getLogger("encoder_service.replicas.redis")
CORRUPT_LOG_S = 10.0  # at most one line about bad values this often


class DirectoryReads:
    def __init__(self, link: RedisLink):
        self._link, self.options, self.counters = link, link.options, link.counters
        self._conns, self.health = link.conns, link.health
        # Directory reads kept for `replica_url_cache_s`: owner -> (its URL, read at); key -> (Located, read at)
        self._replica_urls: dict[str, tuple[str | None, float]] = {}
        self._locations: OrderedDict[str, tuple[Located, float]] = OrderedDict()
        # Row copies' headers read, with the health generation they were read in (one from before an outage
        # is not trusted after it).
        self._headers: OrderedDict[str, tuple[EntryHeader, bytes, int]] = OrderedDict()
        self._corrupt_logged_at, self._corrupt_logged = -CORRUPT_LOG_S, 0  # the last line about bad values
        self._told_shared_url = False  # another replica advertises this one's address (logged once)

    async def get(self, key: str) -> Entry | None:
        """The whole row copy, verified; None on a miss, a corrupt value, or while Redis is down."""
        return await self._read(key, self._get)

    async def read_rows(self, key: str, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) of the row copy, read with GETRANGE, verified; None on a miss or a corrupt value.
        InvalidInput when the range is outside the stored entry; Unavailable while Redis is down or lost
        during the read (the id may well exist: a 503 the clients retry, never a 404)."""
        return await self._read(key, self._read_rows, start, end, strict=True)

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

    def forget_location(self, key: str, owner: str) -> None:
        """A fetch found that `owner` does not give `key`'s rows (gone, or lost them): look both up afresh."""
        self._replica_urls.pop(owner, None)
        self._locations.pop(key, None)

    def drop_location(self, key: str) -> None:
        """`key`'s location changed (written here, landed, taken over): read it afresh next time."""
        self._locations.pop(key, None)

    def drop_header(self, key: str) -> None:
        """`key`'s row copy was written again: its header is read afresh next time."""
        self._headers.pop(key, None)

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
        if owner == self._link.owner:
            return None
        now = time.monotonic()
        cached = self._replica_urls.get(owner)
        if cached is not None and now - cached[1] < self.options.replica_url_cache_s:
            return cached[0]
        value = await self._conns.run("get", directory.replica_name(owner))
        url = value.decode("utf-8", "replace") if value else None
        if url is not None and url == self._link.owner_url:
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
        entry = await maybe_in_thread(len(data), Entry.from_bytes, data, key)
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
                    rows = await maybe_in_thread(len(blocks), rows_from_blocks, header, trailer, start, end, blocks)
                except CorruptEntry as exc:  # corrupt, or a SET landed between the pipeline's commands
                    problem = exc.message
                else:
                    self.counters["range_hits"] += 1
                    return rows
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
