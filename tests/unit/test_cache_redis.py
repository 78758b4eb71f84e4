"""The shared form of the replicas' face (`Shared`: the store, then the Redis tier) against a real redis-server
(8 MB, allkeys-lru, persistence off, 127.0.0.1)."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
import redis
import redis.asyncio as aioredis
import torch

from encoder_service import errors
from encoder_service.replicas.directory import location_name
from encoder_service.cache.entry import HEADER_LEN, CorruptEntry, EntryHeader, verify_rows
from tests.support.stores import LOADED, STATE_WAIT_S, make_entry, open_store
from tests.support.waits import async_wait_for

CASES = [  # (num_rows, row_width, layout, dtype): Qwen2.5 'main' and Qwen3 [main|ds1|ds2|ds3] stand-ins
    (300, 256, "main", torch.bfloat16),
    (300, 256, "main", torch.float32),
    (120, 4 * 96, "main+deepstack3", torch.bfloat16),
    (120, 4 * 96, "main+deepstack3", torch.float32),
]


def log_count(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.name.startswith("encoder_service.replicas"))


@pytest.mark.parametrize("num_rows,row_width,layout,dtype", CASES)
async def test_range_reads_equal_slices_of_the_whole_entry(redis_server, num_rows, row_width, layout, dtype):
    writer, reader = await open_store(redis_server.url), await open_store(redis_server.url)
    entry = make_entry(7, num_rows, row_width, layout, dtype)
    writer.put("k", entry)
    await writer.redis.flush()
    whole = await reader.redis.reads.get("k")
    assert whole is not None and torch.equal(whole.tensor, entry.tensor)
    rng = random.Random(0)
    h = entry.header
    ranges = [(0, num_rows), (0, 1), (num_rows - 1, num_rows), (h.block_rows - 1, h.block_rows + 1)]
    ranges += [tuple(sorted(rng.sample(range(num_rows + 1), 2))) for _ in range(20)]
    for start, end in ranges:
        got = await reader.read_rows("k", start, end)  # reader's local tier is empty: GETRANGE
        assert got is not None and got.dtype == dtype and torch.equal(got, entry.tensor[start:end]), (start, end)
    assert reader.stats()["redis_range_hits"] == len(ranges) and reader.stats()["local_entries"] == 0
    await writer.close()
    await reader.close()


async def test_two_stores_share_one_redis(redis_server):
    a, b = await open_store(redis_server.url), await open_store(redis_server.url)
    entry = make_entry(1)
    a.put("shared", entry)
    await a.redis.flush()
    got = await b.get("shared")
    assert got is not None and torch.equal(got.tensor, entry.tensor)
    assert b.stats()["redis_hits"] == 1 and b.stats()["local_entries"] == 1  # promoted to b's local tier
    await a.close()
    await b.close()


async def test_eviction_under_pressure_is_a_miss_never_a_wrong_answer(redis_server):
    writer = await open_store(redis_server.url)
    entries = {f"k{i}": make_entry(i, 512, 256, "main", torch.float32) for i in range(48)}  # 48 x 512 KiB
    for key, entry in entries.items():
        writer.put(key, entry)
        await writer.redis.flush()
    reader = await open_store(redis_server.url)
    present = 0
    for key, entry in entries.items():
        rows = await reader.read_rows(key, 100, 300)
        whole = await reader.get(key)
        assert rows is None or torch.equal(rows, entry.tensor[100:300])
        assert whole is None or torch.equal(whole.tensor, entry.tensor)
        present += whole is not None
    # Redis evicted some (24 MB into 8 MB), kept some. Which ones is Redis's approximate LRU (it samples a few
    # keys per eviction), not a promise of ours: no assertion on the order.
    assert 0 < present < len(entries)
    assert reader.stats()["redis_corrupt"] == 0
    await writer.close()
    await reader.close()


async def test_corrupt_truncated_and_foreign_values_are_misses(redis_server):
    store = await open_store(redis_server.url)
    entry = make_entry(5, 300, 256, "main", torch.bfloat16)
    store.put("k", entry)
    await store.redis.flush()
    direct = redis.Redis.from_url(redis_server.url)
    good = direct.get("k")
    h = EntryHeader.parse(good, "k")
    other = make_entry(6).to_bytes("another-key")
    bad_values = {
        "payload bytes overwritten": good[: HEADER_LEN + 10] + b"\xff\xff\xff\xff" + good[HEADER_LEN + 14 :],
        "header bytes overwritten": good[:12] + b"\x00\x00" + good[14:],
        "truncated": good[: HEADER_LEN + 5 * h.row_bytes],
        "extended": good + b"junk",
        "foreign bytes": b"some other service's value" * 100,
        "valid entry of another key": other,
    }
    for name, bad in bad_values.items():
        direct.set("k", bad)
        fresh = await open_store(redis_server.url)
        assert await fresh.get("k") is None, name
        assert await fresh.read_rows("k", 0, 8) is None, name  # rows 0..8 include the overwritten bytes
        assert fresh.stats()["redis_corrupt"] >= 2, name
        fresh.put("k", entry)  # encoded again
        await fresh.redis.flush()  # the recomputed entry overwrites the bad value
        assert direct.get("k") == good, name
        await fresh.close()
    direct.close()
    await store.close()


async def test_bad_values_are_counted_every_time_and_logged_rarely(redis_server, caplog):
    """A value rewritten while another replica reads it reads as corrupt, thousands of times a second under
    load: each is counted, one line is logged per CORRUPT_LOG_S (before: a WARNING per read)."""
    caplog.set_level(logging.WARNING, logger="encoder_service.replicas")
    store = await open_store(redis_server.url)
    with redis.Redis.from_url(redis_server.url) as direct:
        direct.set("k", b"some other service's value" * 10)
    for _ in range(200):
        assert await store.get("k") is None
    assert store.stats()["redis_corrupt"] == 200
    assert log_count(caplog, "ignoring bad value") == 1
    await store.close()


async def test_header_alone_is_read_and_verified(redis_server):
    # The reader keeps no directory read (replica_url_cache_s=0): each header below is read afresh.
    writer, reader = await open_store(redis_server.url), await open_store(redis_server.url, replica_url_cache_s=0)
    entry = make_entry(3, 120, 4 * 96, "main+deepstack3", torch.bfloat16)
    writer.put("k", entry)
    await writer.redis.flush()
    direct = redis.Redis.from_url(redis_server.url)
    sent = direct.info("stats")["total_net_output_bytes"]
    header = await reader.header("k")
    assert header is not None and header.num_rows == 120 and header.row_width == 4 * 96
    assert (header.grid_thw, header.layout, header.dtype) == (entry.header.grid_thw, "main+deepstack3", torch.bfloat16)
    assert direct.info("stats")["total_net_output_bytes"] - sent < 4096  # the rows (92 KB) were not pulled
    stats = reader.stats()
    assert stats["redis_located"] == 1 and stats["redis_hits"] == 0 and reader.store.peek("k") is None
    assert stats["local_entries"] == 0  # nothing promoted
    assert await reader.header("missing") is None
    # The row copy's own header, verified (without the location the writer's heartbeat renews: none here).
    direct.delete(location_name("k"))
    assert (await reader.header("k")).num_rows == 120
    good = direct.get("k")
    for name, bad in {"truncated": good[:-8], "header bytes overwritten": good[:12] + b"\x00\x00" + good[14:],
                      "valid entry of another key": make_entry(6).to_bytes("another-key")}.items():
        direct.set("k", bad)
        assert await reader.header("k") is None, name
    assert reader.stats()["redis_corrupt"] == 3 and await reader.header("missing") is None
    direct.close()
    await writer.close()
    await reader.close()


async def test_a_location_carries_the_rows_block_checksums(redis_server):
    """Issue 38: what a replica checks the rows another one sends against (replicas/peers.py); a location written
    before the checksums were is still read (without them), one whose checksums are not its header's is none."""
    writer, reader = await open_store(redis_server.url), await open_store(redis_server.url, replica_url_cache_s=0)
    entry = make_entry(4, 300, 256)
    writer.put("k", entry)
    await writer.redis.flush()
    located = await reader.locate("k")
    header = located.header
    assert located.owner == writer.redis.owner and len(located.block_sums) == 8 * header.num_blocks > 8
    first, last = header.block_span(130, 170)  # a range: the blocks covering it
    lo, hi = first * header.block_rows, min(last * header.block_rows, header.num_rows)
    verify_rows(header, located.block_sums, first, entry.rows(lo, hi).contiguous())
    other = entry.rows(lo, hi).clone()
    other[-1, -1] += 1
    with pytest.raises(CorruptEntry, match="checksum mismatch"):
        verify_rows(header, located.block_sums, first, other)
    direct = redis.Redis.from_url(redis_server.url)
    value = direct.get(location_name("k"))
    older = value[:value.index(b" ") + 1 + HEADER_LEN]  # `<owner> <header>`: before issue 38
    direct.set(location_name("k"), older)
    assert (await reader.locate("k")).block_sums == b"" and (await reader.header("k")).num_rows == 300
    direct.set(location_name("k"), older + bytes(len(located.block_sums)))  # checksums not the header's
    assert await reader.locate("k") is None and reader.stats()["redis_corrupt"] == 1
    direct.close()
    await writer.close()
    await reader.close()


async def test_range_read_notices_a_value_replaced_after_its_header_was_cached(redis_server):
    store = await open_store(redis_server.url)
    first, second = make_entry(1), make_entry(2)
    direct = redis.Redis.from_url(redis_server.url)
    direct.set("k", first.to_bytes("k"))
    assert torch.equal(await store.read_rows("k", 0, 4), first.tensor[:4])  # header now cached
    direct.set("k", second.to_bytes("k"))  # e.g. evicted and rewritten by a replica on another GPU
    assert torch.equal(await store.read_rows("k", 0, 4), second.tensor[:4])
    direct.delete("k")
    assert await store.read_rows("k", 0, 4) is None
    direct.close()
    await store.close()


async def test_a_range_read_that_mixes_two_values_is_detected_and_read_again(redis_server, monkeypatch):
    """Range reads are not transactions: a SET may land between the pipeline's commands. Simulated here: the
    header comes from the old value (equal to the cached one), blocks and trailer from the new one."""
    store = await open_store(redis_server.url)
    first, second = make_entry(1), make_entry(2)  # the same shape: the same offsets, other bytes
    direct = redis.Redis.from_url(redis_server.url)
    direct.set("k", first.to_bytes("k"))
    assert torch.equal(await store.read_rows("k", 0, 4), first.tensor[:4])  # first's header now cached
    direct.set("k", second.to_bytes("k"))
    pipelined, mixed = store.redis._conns.pipelined, []

    async def interleaved(*commands):
        replies = await pipelined(*commands)
        if len(commands) == 4 and not mixed:  # the first range read: [header, STRLEN, blocks, trailer]
            mixed.append(1)
            replies[0] = first.to_bytes("k")[:HEADER_LEN]
        return replies

    monkeypatch.setattr(store.redis._conns, "pipelined", interleaved)
    assert torch.equal(await store.read_rows("k", 0, 4), second.tensor[:4])  # read again, never mixed
    assert mixed and store.stats()["redis_corrupt"] == 0
    direct.close()
    await store.close()


async def test_redis_killed_and_restarted_mid_run(redis_server, caplog):
    """Rows finished while Redis is down wait in the backlog and are written once it is back (issue 22 item
    2; before, they were dropped: another replica answered 404 for them from then on); so are the ids leased
    here from before the outage, which the restarted (empty) Redis lost."""
    caplog.set_level(logging.INFO, logger="encoder_service.replicas")
    store = await open_store(redis_server.url)
    store.store.pin("a", nbytes=1)  # leased here, as an encode pins its id
    store.put("a", make_entry(1))
    await store.redis.flush()
    redis_server.kill()
    for i in range(20):  # keeps encoding and serving from the local tier
        assert await store.get(f"b{i}") is None  # a miss, at once
        store.put(f"b{i}", make_entry(100 + i))  # the encode's rows: kept locally, their write waits
        assert torch.equal((await store.get(f"b{i}")).tensor, make_entry(100 + i).tensor)
        assert torch.equal(await store.read_rows("a", 0, 3), make_entry(1).tensor[:3])
        with pytest.raises(errors.Unavailable):  # Redis cannot tell now: a 503 the clients retry, never a 404
            await store.read_rows(f"never{i}", 0, 1)
    stats = store.stats()
    assert stats["redis_state"] == "down" and stats["redis_down_events"] == 1
    assert stats["redis_writes_dropped"] == 0 and stats["redis_queued_bytes"] > 0  # the backlog
    assert log_count(caplog, "redis tier unavailable") == 1  # once, not per request
    redis_server.start()
    await async_wait_for(lambda: store.redis.up, "the tier up again", STATE_WAIT_S)
    assert log_count(caplog, "reachable again") == 1
    store.put("c", make_entry(3))  # writes resume
    await store.redis.flush()
    other = await open_store(redis_server.url)
    for key, seed in [("c", 3), ("a", 1)] + [(f"b{i}", 100 + i) for i in range(20)]:
        if key == "a":  # written again by the store once it saw Redis back
            await async_wait_for(lambda: store.stats()["reshared"] == 1, "the entry written again", STATE_WAIT_S)
            await store.redis.flush()
        got = await other.get(key)
        assert got is not None and torch.equal(got.tensor, make_entry(seed).tensor), key
    assert store.stats()["redis_writes_after_outage"] == 20
    await other.close()
    await store.close()


async def test_rows_finished_while_redis_stops_answering_are_written_after(redis_server):
    """A 2 s SIGSTOP: the writes that timed out, and those made while the tier was down, all land after."""
    store = await open_store(redis_server.url)
    redis_server.pause()
    try:
        for i in range(10):
            store.put(f"k{i}", make_entry(i))
        await async_wait_for(lambda: not store.redis.up, "the tier down", STATE_WAIT_S)  # the first write timed out
        await asyncio.sleep(2.0)
    finally:
        redis_server.resume()
    await async_wait_for(lambda: store.redis.up, "the tier up again", STATE_WAIT_S)
    await store.redis.flush()
    other = await open_store(redis_server.url)
    for i in range(10):
        got = await other.get(f"k{i}")
        assert got is not None and torch.equal(got.tensor, make_entry(i).tensor), i
    assert store.stats()["redis_writes_dropped"] == 0
    await other.close()
    await store.close()


async def test_the_backlog_is_bounded_and_what_it_drops_is_counted(redis_server):
    entry = make_entry(0)
    store = await open_store(redis_server.url, max_queued_bytes=3 * entry.nbytes)
    redis_server.kill()
    await store.get("x")  # the tier notices
    for i in range(5):
        store.put(f"k{i}", make_entry(i))
    stats = store.stats()  # a copy over the bound is dropped, never the location: every id stays findable
    assert stats["redis_copies_dropped_full"] == 2 and stats["redis_queued_bytes"] == 3 * entry.nbytes
    assert stats["redis_writes_dropped_full"] == 0
    redis_server.start()
    await async_wait_for(lambda: store.redis.up, "the tier up again", STATE_WAIT_S)
    await store.redis.flush()
    with redis.Redis.from_url(redis_server.url) as direct:
        assert [direct.exists(f"k{i}") for i in range(5)] == [1, 1, 1, 0, 0]  # the first three copies, in order
        assert all(direct.exists(location_name(f"k{i}")) for i in range(5))
    await store.close()


async def test_slow_redis_times_out_and_recovers(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="encoder_service.replicas")
    store = await open_store(redis_server.url)
    store.put("a", make_entry(1))
    await store.redis.flush()
    redis_server.pause()  # accepts nothing, answers nothing: only the socket timeout ends a request
    try:
        assert await asyncio.wait_for(store.get("b"), timeout=3) is None
        assert store.stats()["redis_state"] == "down"
        # Down: later reads skip Redis at once instead of waiting for another timeout (Unavailable: a 503).
        with pytest.raises(errors.Unavailable):
            await asyncio.wait_for(store.read_rows("x", 0, 1), timeout=0.1)
    finally:
        redis_server.resume()
    await async_wait_for(lambda: store.redis.up, "the tier up again", STATE_WAIT_S)
    assert torch.equal(await store.redis.reads.read_rows("a", 0, 2), make_entry(1).tensor[:2])
    assert log_count(caplog, "redis tier unavailable") == 1
    await store.close()


async def test_full_redis_without_eviction_pauses_writes_and_keeps_serving(redis_server_noevict, caplog):
    caplog.set_level(logging.INFO, logger="encoder_service.replicas")
    url = redis_server_noevict.url
    store = await open_store(url)
    entries = [make_entry(i, 512, 256, "main", torch.float32) for i in range(12)]  # 12 x 512 KiB into 2 MB
    for i, entry in enumerate(entries):
        store.put(f"k{i}", entry)
        await store.redis.flush()
    for i, entry in enumerate(entries):
        assert torch.equal((await store.get(f"k{i}")).tensor, entry.tensor)  # all served locally
    stats = store.stats()
    assert stats["redis_oom_events"] == 1 and stats["redis_copies_dropped"] >= 1  # the rows; their locations fit
    assert log_count(caplog, "redis tier is full") == 1
    assert stats["redis_state"] == "up"  # full is not down: reads still go to Redis
    direct = redis.Redis.from_url(url)
    direct.config_set("maxmemory", "64mb")  # the operator makes room
    await asyncio.sleep(0.25)  # past the 0.2 s OOM cool-down
    store.put("late", make_entry(99))
    await store.redis.flush()
    assert direct.exists("late") == 1
    assert log_count(caplog, "writes succeed again") == 1
    direct.close()
    await store.close()


async def test_the_oom_pause_probes_sooner_and_backs_off_while_redis_stays_full(redis_server_noevict):
    """Writes paused by an OOM reply resume after half a second once Redis has room again (before: a fixed
    30 s); while it stays full, each OOM in a row doubles the pause, up to its cap (issue 22 item 6)."""
    url = redis_server_noevict.url
    store = await open_store(url, oom_pause_min_s=0.5, oom_pause_max_s=2.0)
    direct = redis.Redis.from_url(url)
    direct.config_set("maxmemory", str(direct.info("memory")["used_memory"] // 2))  # full now
    pauses = []
    for i in range(4):
        store.put(f"k{i}", make_entry(i))
        await store.redis.flush()
        pauses.append(store.redis.health.oom_pause_s)
        await async_wait_for(lambda: not store.stats()["redis_writes_paused"], "the OOM pause to end", STATE_WAIT_S)
    assert pauses == [0.5, 1.0, 2.0, 2.0]
    direct.config_set("maxmemory", "64mb")  # the operator makes room
    store.put("late", make_entry(9))
    await store.redis.flush()
    assert direct.exists("late") == 1 and store.redis.health.oom_pause_s == 0  # back to the start
    direct.config_set("maxmemory", str(direct.info("memory")["used_memory"] // 2))
    store.put("again", make_entry(11, 2048))
    await store.redis.flush()
    assert store.redis.health.oom_pause_s == 0.5
    await asyncio.sleep(0.6)
    direct.config_set("maxmemory", "64mb")
    store.put("soon", make_entry(12))  # 0.6 s after the OOM, not 30 s
    await store.redis.flush()
    assert direct.exists("soon") == 1
    direct.close()
    await store.close()


async def test_writes_refused_during_an_oom_pause_do_not_extend_it(redis_server_noevict):
    """Before, every write refused during the pause (one sent before it began, or a location, which does not
    wait for it) extended it: under load a full Redis freed after 30 s stayed paused until 60 s. Only the
    pause's own probe (the first write after it) may extend it now."""
    url = redis_server_noevict.url
    store = await open_store(url, oom_pause_min_s=1.0, oom_pause_max_s=30.0)
    direct = redis.Redis.from_url(url)
    direct.config_set("maxmemory", str(direct.info("memory")["used_memory"] // 2))  # full now
    store.put("first", make_entry(0))
    await store.redis.flush()
    paused_until = store.redis.health.paused_until
    assert paused_until and store.redis.health.oom_pause_s == 1.0
    for i in range(20):  # under load: their locations are refused too, within the pause
        store.put(f"k{i}", make_entry(i + 1))
    await store.redis.flush()
    assert store.redis.health.paused_until == paused_until and store.redis.health.oom_pause_s == 1.0
    direct.config_set("maxmemory", "64mb")  # freed
    await async_wait_for(lambda: not store.stats()["redis_writes_paused"], "the pause to end", STATE_WAIT_S)
    store.put("after", make_entry(99))
    await store.redis.flush()
    assert direct.exists("after") == 1 and store.redis.health.oom_pause_s == 0
    direct.close()
    await store.close()


async def test_unreachable_at_start_then_comes_up(caplog):
    from tests.support.redis_server import RedisServer

    caplog.set_level(logging.INFO, logger="encoder_service.replicas")
    server = RedisServer()
    store = await open_store(server.url)  # nothing listening yet
    try:
        assert await store.get("a") is None and not store.redis.up
        store.put("a", make_entry(1))
        assert torch.equal((await store.get("a")).tensor, make_entry(1).tensor)
        server.start()
        await async_wait_for(lambda: store.redis.up, "the tier up again", STATE_WAIT_S)
        store.put("b", make_entry(2))
        await store.redis.flush()
        assert (await store.redis.reads.get("b")) is not None
    finally:
        await store.close()
        server.stop()


# ---- pool exhaustion, a full Redis without eviction, restarts (ISSUE 13 items 2-4) -------------------


async def test_more_concurrent_reads_than_connections_wait_and_all_succeed(redis_server):
    writer = await open_store(redis_server.url)
    # Small entries (12 KB): 64 replies in flight are buffered in Redis, and an 8 MB allkeys-lru server
    # would evict keys to make room for bigger ones.
    entries = {f"k{i}": make_entry(i, 48, 128) for i in range(16)}
    for key, entry in entries.items():
        writer.put(key, entry)
    await writer.redis.flush()
    reader = await open_store(redis_server.url, **LOADED)  # 64 connections (the default), empty local tier
    keys = [f"k{i % 16}" for i in range(128)]

    async def header_and_rows(key: str, start: int):
        return await reader.header(key), await reader.read_rows(key, start, start + 30)

    async def write_meanwhile():
        reader.put("new", make_entry(99))
        await reader.redis.flush()

    ranged, whole, _ = await asyncio.gather(
        asyncio.gather(*(header_and_rows(key, i % 18) for i, key in enumerate(keys))),
        asyncio.gather(*(reader.redis.reads.get(key) for key in keys)),
        write_meanwhile(),
    )
    for i, (key, (header, rows)) in enumerate(zip(keys, ranged)):
        assert header is not None and header.num_rows == 48, key
        assert rows is not None and torch.equal(rows, entries[key].tensor[i % 18 : i % 18 + 30]), key
    for key, got in zip(keys, whole):
        assert got is not None and torch.equal(got.tensor, entries[key].tensor), key
    stats = reader.stats()
    assert stats["redis_state"] == "up" and stats["redis_down_events"] == 0 and stats["redis_errors"] == 0
    assert stats["redis_pool_waits"] > 0 and stats["redis_pool_timeouts"] == 0  # they waited, none gave up
    assert stats["redis_writes"] == 1 and stats["redis_writes_dropped"] == 0
    assert redis.Redis.from_url(redis_server.url).info("stats")["evicted_keys"] == 0
    await writer.close()
    await reader.close()


async def test_full_redis_without_eviction_still_reads_and_only_writes_pause(redis_server_noevict):
    url = redis_server_noevict.url
    writer = await open_store(url)
    entries = {f"k{i}": make_entry(i, 300, 256) for i in range(3)}  # 3 x 150 KB: fits in 2 MB
    for key, entry in entries.items():
        writer.put(key, entry)
    await writer.redis.flush()
    direct = redis.Redis.from_url(url)
    direct.config_set("maxmemory", str(direct.info("memory")["used_memory"] // 2))  # over maxmemory now
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # MULTI/EXEC is refused, even of reads
        with direct.pipeline(transaction=True) as pipe:
            pipe.getrange("k0", 0, 7)
            pipe.execute()
    reader = await open_store(url)
    for key, entry in entries.items():
        header = await reader.header(key)
        rows = await reader.read_rows(key, 10, 200)
        whole = await reader.redis.reads.get(key)
        assert header is not None and header.num_rows == 300, key
        assert rows is not None and torch.equal(rows, entry.tensor[10:200]), key
        assert whole is not None and torch.equal(whole.tensor, entry.tensor), key
    stats = reader.stats()
    assert stats["redis_errors"] == 0 and stats["redis_state"] == "up" and not stats["redis_writes_paused"]

    async def refused_read(key: str):  # a read Redis refuses when full (a MULTI, as range reads once were)
        async with aioredis.Redis.from_url(url) as client, client.pipeline(transaction=True) as pipe:
            pipe.getrange(key, 0, 7)
            return await pipe.execute()

    assert await reader.redis.reads._read("k0", refused_read) is None  # a miss...
    stats = reader.stats()
    assert stats["redis_errors"] == 1 and stats["redis_oom_events"] == 0 and not stats["redis_writes_paused"]
    reader.put("late", make_entry(9))  # ...and only a refused write pauses writes
    await reader.redis.flush()
    stats = reader.stats()
    assert stats["redis_oom_events"] == 1 and stats["redis_writes_paused"] and stats["redis_writes_dropped"] == 1
    assert torch.equal(await reader.read_rows("k1", 0, 5), entries["k1"].tensor[:5])  # reads go on
    direct.close()
    await writer.close()
    await reader.close()


def _put(url: str, entries: dict) -> None:
    with redis.Redis.from_url(url) as direct:
        for key, entry in entries.items():
            direct.set(key, entry.to_bytes(key))


async def _get_all(store, entries: dict) -> None:
    got = await asyncio.gather(*(store.redis.reads.get(key) for key in entries))
    for (key, entry), value in zip(entries.items(), got):
        assert value is not None and torch.equal(value.tensor, entry.tensor), key


async def test_first_reads_after_an_unnoticed_restart_retry_once_on_a_fresh_connection(redis_server):
    store = await open_store(redis_server.url)
    entries = {f"k{i}": make_entry(i, 64, 128) for i in range(20)}
    _put(redis_server.url, entries)
    await _get_all(store, entries)  # 20 connections in the pool now
    redis_server.restart()  # every pooled connection is dead, and the tier saw no error yet
    _put(redis_server.url, entries)
    await _get_all(store, entries)  # each read that drew a dead connection ran again on a fresh one
    stats = store.stats()
    assert stats["redis_retries"] >= 1 and stats["redis_errors"] == 0 and stats["redis_down_events"] == 0
    await store.close()


async def test_restart_recovers_within_one_probe_interval_and_then_reads_succeed(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="encoder_service.replicas")
    probe_max_s = 0.5
    store = await open_store(redis_server.url, probe_min_s=0.1, probe_max_s=probe_max_s)
    entries = {f"k{i}": make_entry(i, 64, 128) for i in range(20)}
    _put(redis_server.url, entries)
    await _get_all(store, entries)  # 20 connections in the pool now
    redis_server.kill()
    assert await store.redis.reads.get("k0") is None and not store.redis.up
    await asyncio.sleep(8 * probe_max_s)  # the probe's backoff reaches its cap (uncapped, it would be 3.2 s)
    redis_server.start()
    answering = time.monotonic()
    await async_wait_for(lambda: store.redis.up, "the tier up again", STATE_WAIT_S)
    # The next probe: one capped interval, plus its PING and slack for a loaded machine (not the 3.2 s an
    # uncapped backoff would have reached).
    assert time.monotonic() - answering < probe_max_s + 1.5
    _put(redis_server.url, entries)
    await _get_all(store, entries)  # the first reads after recovery: no stale connection left to fail on
    stats = store.stats()
    assert stats["redis_down_events"] == 1 and stats["redis_state"] == "up"  # no flapping
    assert log_count(caplog, "redis tier unavailable") == 1 and log_count(caplog, "reachable again") == 1
    await store.close()
