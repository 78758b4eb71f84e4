"""The handoff of an id between replicas (replicas/directory.py), against a real redis-server: two `Shared` faces
on one Redis stand for replica A, which accepts an image and encodes it, and replica B, which serves a fetch
for it. Without the handoff, B answered 404 until A's rows happened to be in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis
import torch
from redis.crc import key_slot

from encoder_service.cache import EmbeddingStore
from encoder_service.replicas import EncodeFailed, Settled, Shared, Solo, background
from encoder_service.replicas.directory import binding_name, input_name, location_name, marker_name
from encoder_service.cache.keys import caller_key, content_hash, make_key
from encoder_service.errors import ImageDecodeError, Unavailable
from tests.support.stores import LOADED, STATE_WAIT_S, make_entry, open_store
from tests.support.waits import async_wait_for

LONG_S = 30.0  # a fetch's timeout far longer than any wake-up below
WOKEN_S = 10.0  # a wake-up by an event, not by LONG_S: generous for a loaded 2-core machine


async def encoded(store: EmbeddingStore, key: str, entry, gate: asyncio.Event) -> None:
    """Replica A's fill of `key` (core/flight.py): the ViT runs until `gate` is set, then the rows are put."""
    await gate.wait()
    store.put(key, entry)


def command_calls(url: str, command: str) -> int:
    with redis.Redis.from_url(url) as direct:
        return direct.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


@contextlib.asynccontextmanager
async def replicas(url: str, **options):
    a, b = await open_store(url, **options), await open_store(url, **options)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def accepted_and_awaited(a: EmbeddingStore, b: EmbeddingStore, key: str) -> asyncio.Task:
    """A accepts `key` (marks it pending, as before answering `encode`); B's fetch waits for it. Returns B's
    wait (a task) once B sleeps on its subscription."""
    waits = b.stats()["redis_pending_waits"]
    assert await a.mark_pending([key])
    waiting = asyncio.create_task(b.wait_for(key, LONG_S))
    await async_wait_for(lambda: b.stats()["redis_pending_waits"] > waits, "B's wait to subscribe", STATE_WAIT_S)
    return waiting


def test_marker_names_follow_the_key_scheme():
    fp = "0123456789abcdef01234567"
    content = make_key(b"pixels", fp).name
    assert content == f"encsvc:{fp}:{{c:blake3:{content_hash(b'pixels')}}}"
    assert marker_name(content) == f"encsvc:{fp}:pending:{{c:blake3:{content_hash(b'pixels')}}}"
    assert marker_name(f"encsvc:{fp}:{{u:doc-7:page/2}}") == f"encsvc:{fp}:pending:{{u:doc-7:page/2}}"
    assert marker_name("k") == "{k}:pending"
    # One Redis Cluster slot for every name of an id (its hash tag), whatever it is
    for name in (content, caller_key("doc-7:page/2", fp).name, "k"):
        names = [name, marker_name(name), input_name(name), location_name(name), binding_name(name)]
        assert len({key_slot(n.encode()) for n in names}) == 1, names


async def test_a_fetch_elsewhere_is_woken_when_the_rows_land(redis_server):
    async with replicas(redis_server.url) as (a, b):
        entry, gate = make_entry(1), asyncio.Event()
        waiting = await accepted_and_awaited(a, b, "k")
        encode = asyncio.create_task(encoded(a, "k", entry, gate))
        # B waits while A encodes (the gate holds A's rows: nothing can land). B is subscribed already
        # (accepted_and_awaited saw its wait): 0.5 s lets a B that answers without the message show it.
        await asyncio.sleep(0.5)
        assert not waiting.done()
        gate.set()
        landed = time.monotonic()
        assert await waiting is Settled.LANDED
        assert time.monotonic() - landed < WOKEN_S  # woken by the message, not at the 30 s timeout
        await encode
        assert torch.equal(await b.read_rows("k", 0, 10), entry.tensor[:10])  # the rows are there
        # No polling: B checked twice (before subscribing and after), then slept until the message.
        assert command_calls(redis_server.url, "exists") == 2
        stats = b.stats()
        assert stats["redis_pending_wakeups"] == 1 and stats["redis_pending_channels"] == 0
        assert redis.Redis.from_url(redis_server.url).exists(marker_name("k")) == 0  # A cleared its marker


async def test_a_failed_encode_is_raised_on_the_other_replica_not_404(redis_server):
    async with replicas(redis_server.url) as (a, b):
        waiting = await accepted_and_awaited(a, b, "bad")
        a.failed("bad", ImageDecodeError("image 0: truncated PNG"))
        failed = time.monotonic()
        with pytest.raises(EncodeFailed) as info:
            await waiting
        assert time.monotonic() - failed < WOKEN_S
        assert info.value.kind == "invalid_input" and "truncated PNG" in info.value.message  # a 400, as on A
        with pytest.raises(EncodeFailed):  # a fetch arriving later reads the failure from the marker
            await asyncio.wait_for(b.wait_for("bad", LONG_S), WOKEN_S)
        assert b.stats()["redis_pending_failures"] == 2


async def test_a_dropped_encode_fails_the_wait_elsewhere_at_once(redis_server):
    """An encode the engine drops (every caller left: its future is cancelled) settles its marker too, so a
    fetch on the other replica gets a clear not-found at once instead of waiting out the lease."""
    async with replicas(redis_server.url) as (a, b):
        waiting = await accepted_and_awaited(a, b, "dropped")
        a.failed("dropped", asyncio.CancelledError())
        dropped = time.monotonic()
        with pytest.raises(EncodeFailed) as info:
            await waiting
        assert time.monotonic() - dropped < WOKEN_S
        assert info.value.kind == "not_found" and "dropped" in info.value.message


async def test_an_id_nobody_accepted_is_not_pending_at_once(redis_server):
    async with replicas(redis_server.url) as (a, b):
        t0 = time.monotonic()
        assert await b.wait_for("never", LONG_S) is Settled.NOT_PENDING  # the caller answers 404
        a.put("there", make_entry(2))
        await a.redis.flush()
        assert await b.wait_for("there", LONG_S) is Settled.LANDED  # in Redis already
        assert time.monotonic() - t0 < WOKEN_S
        assert b.stats()["redis_subscriber_connects"] == 0  # nothing to wait for: no subscription
    local_only = Solo(EmbeddingStore(1 << 20))
    assert await local_only.wait_for("x", LONG_S) is Settled.NOT_PENDING  # no Redis: nothing to wait on


async def test_a_wait_ends_at_the_callers_timeout(redis_server):
    async with replicas(redis_server.url) as (a, b):
        assert await a.mark_pending(["slow"])  # A never finishes within the wait
        t0 = time.monotonic()
        assert await b.wait_for("slow", 0.3) is Settled.TIMED_OUT
        assert 0.3 <= time.monotonic() - t0 < WOKEN_S
        stats = b.stats()
        assert stats["redis_pending_timeouts"] == 1 and stats["redis_pending_channels"] == 0  # unsubscribed
        # timeout 0, "don't wait": the state now, from one check, without subscribing
        a.put("there", make_entry(2))
        await a.redis.flush()
        assert await b.wait_for("slow", 0) is Settled.TIMED_OUT
        assert await b.wait_for("never", 0) is Settled.NOT_PENDING
        assert await b.wait_for("there", 0) is Settled.LANDED
        assert b.stats()["redis_subscriber_connects"] == 1 and b.stats()["redis_pending_waits"] == 1


async def test_waits_cut_short_leave_no_subscription_behind(redis_server):
    """Fetches that time out at any point of their wait (before, during or after their SUBSCRIBE is sent)
    unsubscribe: nothing accumulates on the shared connection."""
    async with replicas(redis_server.url) as (a, b):
        keys = [f"k{i}" for i in range(20)]
        assert await a.mark_pending(keys)
        timeouts = [0.0005 * i for i in range(200)]  # 0 to 0.1 s
        got = await asyncio.gather(*(b.wait_for(keys[i % 20], t) for i, t in enumerate(timeouts)))
        assert set(got) == {Settled.TIMED_OUT} and b.stats()["redis_pending_channels"] == 0

        def subscriptions() -> int:
            with redis.Redis.from_url(redis_server.url) as direct:
                return sum(int(c["sub"]) for c in direct.client_list())

        await async_wait_for(lambda: subscriptions() == 0, "the UNSUBSCRIBEs to reach Redis", STATE_WAIT_S)
        assert await b.wait_for("never", LONG_S) is Settled.NOT_PENDING  # and the connection still works
        waiting = await accepted_and_awaited(a, b, "k0")
        a.put("k0", make_entry(7))
        assert await asyncio.wait_for(waiting, WOKEN_S) is Settled.LANDED


async def crash(store: Shared) -> None:
    """The replica stops dead (SIGKILL, as far as Redis can tell): its heartbeat no longer renews anything
    (stopped for sure: a cancellation lost in a round trip would leave it renewing)."""
    await background.stop([store.redis._tasks["heartbeat"]])


# A marker outlives its owner by 2 s: 20 heartbeats, so a live owner keeps it even when this loop or
# redis-server is starved of CPU for a second.
LIVENESS = dict(pending_ttl_s=2.0, heartbeat_s=0.1)


async def test_a_live_owner_keeps_its_marker_and_a_dead_one_is_known_within_the_ttl(redis_server):
    """The marker lives only while its owner renews it (issue 22 item 1): a waiter keeps waiting on a live
    owner well past the marker's TTL, and learns within the TTL that a dead one is gone, with the image
    bytes it needs to encode it itself (ORPHANED) instead of waiting out the lease (before: 300 s)."""
    async with replicas(redis_server.url, **LIVENESS) as (a, b):
        data = b"the accepted image's bytes"
        assert await a.mark_pending(["k"], inputs={"k": data})
        waiting = asyncio.create_task(b.wait_for("k", LONG_S))
        await asyncio.sleep(2 * LIVENESS["pending_ttl_s"])  # A lives (encodes on): its heartbeat renews
        assert not waiting.done()
        await crash(a)
        crashed = time.monotonic()
        assert await waiting is Settled.ORPHANED
        assert time.monotonic() - crashed < LIVENESS["pending_ttl_s"] + 3  # the TTL, not LONG_S
        assert await b.input("k") == data  # what B encodes in A's place
        assert await b.wait_for("k", LONG_S) is Settled.ORPHANED  # a later wait: at once
        assert b.stats()["redis_pending_orphaned"] == 2
        assert await b.wait_for("never", LONG_S) is Settled.NOT_PENDING  # no marker, no bytes: nobody has it


async def test_the_first_claim_wins_and_the_other_replica_waits(redis_server):
    """Two replicas accepting the same new image at once (issue 22 item 4): one claim wins, the other learns
    that the image is being encoded elsewhere; a failure marker or a claim of its own from before does not
    stand in the way."""
    async with replicas(redis_server.url) as (a, b):
        on_a, on_b = await asyncio.gather(a.mark_pending(["k", "j"]), b.mark_pending(["k", "j"]))
        assert on_a.ok and on_b.ok
        assert on_a.elsewhere | on_b.elsewhere == {"k", "j"} and not on_a.elsewhere & on_b.elsewhere  # one each
        winner, loser = (a, b) if "k" in on_b.elsewhere else (b, a)
        assert "k" not in (await winner.mark_pending(["k"])).elsewhere  # its own claim again: still its own
        waiting = asyncio.create_task(loser.wait_for("k", LONG_S))
        winner.failed("k", ImageDecodeError("truncated"))
        with pytest.raises(EncodeFailed):
            await waiting
        assert "k" not in (await loser.mark_pending(["k"])).elsewhere  # a failure marker: replaced
        assert a.stats()["redis_pending_elsewhere"] + b.stats()["redis_pending_elsewhere"] >= 1


async def test_an_owner_that_gives_up_releases_the_image_to_a_waiter(redis_server):
    """An encode the owner gives up for a reason of its own (shutting down, its engine died) is released,
    not failed: a waiter takes it over at once; so are the claims still held when a replica stops."""
    async with replicas(redis_server.url) as (a, b):
        assert await a.mark_pending(["k", "j"], inputs={"k": b"k bytes", "j": b"j bytes"})
        waiting = asyncio.create_task(b.wait_for("k", LONG_S))
        await async_wait_for(lambda: b.stats()["redis_pending_waits"] == 1, "B's first wait", STATE_WAIT_S)
        a.failed("k", Unavailable("the service is shutting down"))
        assert await asyncio.wait_for(waiting, WOKEN_S) is Settled.ORPHANED
        assert await b.input("k") == b"k bytes"
        waiting = asyncio.create_task(b.wait_for("j", LONG_S))
        await async_wait_for(lambda: b.stats()["redis_pending_waits"] == 2, "B's second wait", STATE_WAIT_S)
        await a.close()  # "j" still claimed: released
        assert await asyncio.wait_for(waiting, WOKEN_S) is Settled.ORPHANED


async def test_claims_and_rows_of_an_outage_are_marked_and_settled_once_redis_is_back(redis_server):
    """A accepts an image and finishes its rows while Redis is down and restarts empty (issue 22 item 2): once
    back, A marks its claim again at once and writes the rows behind it, and B's wait ends with them. Right
    after B's own recovery an id without a marker is 'unavailable' (A may not have marked it again yet),
    not unknown."""
    async with replicas(redis_server.url) as (a, b):
        assert await a.mark_pending(["early"], inputs={"early": b"early bytes"})
        redis_server.kill()
        assert await b.wait_for("early", LONG_S) is Settled.UNAVAILABLE  # B's tier goes down with it
        marked = await a.mark_pending(["late"], inputs={"late": b"late bytes"})  # accepted during the outage
        assert not marked and not a.redis.up
        a.put("early", make_entry(1))  # finished during the outage: queued
        redis_server.start()
        await async_wait_for(lambda: b.redis.up, "B's tier up again", STATE_WAIT_S)
        assert await b.wait_for("unknown", LONG_S) is Settled.UNAVAILABLE  # within B's recovery grace
        await async_wait_for(lambda: a.redis.up, "A's tier up again", STATE_WAIT_S)
        await a.redis.flush()
        assert await b.wait_for("early", LONG_S) is Settled.LANDED
        assert torch.equal(await b.read_rows("early", 0, 300), make_entry(1).tensor)
        with redis.Redis.from_url(redis_server.url) as direct:
            await async_wait_for(lambda: direct.exists(marker_name("late")) == 1, "A's queued claim on 'late'",
                                 STATE_WAIT_S)
        waits = b.stats()["redis_pending_waits"]
        waiting = asyncio.create_task(b.wait_for("late", LONG_S))  # A's claim, marked again: B waits
        await async_wait_for(lambda: waiting.done() or b.stats()["redis_pending_waits"] > waits, "B's wait",
                             STATE_WAIT_S)
        assert not waiting.done()
        a.put("late", make_entry(2))
        assert await asyncio.wait_for(waiting, 2.0) is Settled.LANDED
        await asyncio.sleep(b.redis.options.recovery_grace_s)
        assert await b.wait_for("unknown", LONG_S) is Settled.NOT_PENDING


async def test_an_outcome_published_between_check_and_subscribe_is_not_missed(redis_server, monkeypatch):
    """B's first check sees "pending"; A's rows land, and its message goes out, before B's SUBSCRIBE: B's
    second check, once subscribed, must see them."""
    async with replicas(redis_server.url) as (a, b):
        entry, gate = make_entry(3), asyncio.Event()
        assert await a.mark_pending(["k"])
        encode = asyncio.create_task(encoded(a, "k", entry, gate))
        subscriber = b.redis._subscriber
        subscribe = subscriber.subscription

        @contextlib.asynccontextmanager
        async def late_subscription(channel):
            gate.set()  # A finishes and publishes while B is between its first check and its SUBSCRIBE
            await encode
            await a.redis.flush()
            async with subscribe(channel) as message:
                yield message

        monkeypatch.setattr(subscriber, "subscription", late_subscription)
        assert await asyncio.wait_for(b.wait_for("k", LONG_S), 2.0) is Settled.LANDED
        assert b.stats()["redis_pending_wakeups"] == 0  # seen by the second check, not by a message


async def test_rows_that_could_not_be_stored_fail_the_wait(redis_server):
    async with replicas(redis_server.url, max_queued_locations=0) as (a, b):  # A's write-behind queue is "full"
        waiting = await accepted_and_awaited(a, b, "k")
        a.put("k", make_entry(4))  # A has the rows (its local tier), Redis not even where they are
        with pytest.raises(EncodeFailed) as info:
            await asyncio.wait_for(waiting, WOKEN_S)
        assert info.value.kind == "not_found" and "not stored" in info.value.message  # 404, saying why
        assert a.stats()["redis_writes_dropped_full"] == 1


async def test_rows_refused_by_a_full_redis_fail_the_wait(redis_server_noevict):
    url = redis_server_noevict.url
    async with replicas(url) as (a, b):
        waiting = await accepted_and_awaited(a, b, "k")
        direct = redis.Redis.from_url(url)
        direct.config_set("maxmemory", str(direct.info("memory")["used_memory"] // 2))  # full now
        a.put("k", make_entry(5, 512, 256, "main", torch.float32))
        with pytest.raises(EncodeFailed) as info:
            await asyncio.wait_for(waiting, WOKEN_S)
        assert info.value.kind == "not_found" and "Redis is full" in info.value.message
        # The failure marker could not be SET when full, so the pending one was deleted: later fetches 404.
        assert await asyncio.wait_for(b.wait_for("k", LONG_S), WOKEN_S) is Settled.NOT_PENDING
        direct.close()


async def test_rows_found_in_redis_settle_the_marker(redis_server):
    async with replicas(redis_server.url) as (a, b):
        b.put("k", make_entry(6))  # another replica wrote the rows already
        await b.redis.flush()
        assert await a.mark_pending(["k"])
        assert await a.get("k") is not None  # A's fill finds the rows in Redis: nothing encoded
        await a.redis.flush()
        assert redis.Redis.from_url(redis_server.url).exists(marker_name("k")) == 0


async def test_kept_bytes_of_landed_ids_are_written_again_after_a_restart(redis_server):
    """An image's bytes stay in Redis for its lease after its rows land, so that another replica can encode it
    again should this one die. A restarted (or failed over) Redis lost them: the replica that kept them writes
    them again (before: only the bytes of claims not yet settled were)."""
    store = await open_store(redis_server.url)
    try:
        assert await store.mark_pending(["k"], inputs={"k": b"the image's bytes"})
        store.put("k", make_entry(1))
        await store.redis.flush()
        redis_server.restart()
        with redis.Redis.from_url(redis_server.url) as direct:
            await async_wait_for(lambda: direct.get(input_name("k")) == b"the image's bytes",
                                 "the kept bytes written again", STATE_WAIT_S)
            assert direct.pttl(input_name("k")) > 0  # for what is left of the lease, not for good
    finally:
        await store.close()


async def test_redis_killed_during_a_wait_answers_at_once(redis_server):
    async with replicas(redis_server.url) as (a, b):
        waiting = await accepted_and_awaited(a, b, "k")
        redis_server.kill()
        t0 = time.monotonic()
        assert await waiting is Settled.UNAVAILABLE
        assert time.monotonic() - t0 < WOKEN_S and not b.redis.up  # the lost subscriber marked the tier down
        assert await asyncio.wait_for(b.wait_for("k", LONG_S), WOKEN_S) is Settled.UNAVAILABLE  # down: at once


async def test_redis_that_stops_answering_during_a_wait_answers_at_once(redis_server):
    async with replicas(redis_server.url) as (a, b):
        waiting = await accepted_and_awaited(a, b, "k")
        redis_server.pause()
        try:
            assert await b.redis.reads.get("other") is None  # B's next command times out: the tier goes down...
            assert await asyncio.wait_for(waiting, WOKEN_S) is Settled.UNAVAILABLE  # ...and the wait ends with it
        finally:
            redis_server.resume()


async def test_512_concurrent_waits_share_one_subscriber_connection(redis_server):
    async with replicas(redis_server.url, **LOADED) as (a, b):
        keys = [f"k{i}" for i in range(64)]
        entries = {key: make_entry(100 + i, 16, 64) for i, key in enumerate(keys)}
        gate = asyncio.Event()
        assert await a.mark_pending(keys)
        encodes = [asyncio.create_task(encoded(a, key, entries[key], gate)) for key in keys]
        waits = [asyncio.create_task(b.wait_for(keys[i % 64], LONG_S)) for i in range(512)]
        await async_wait_for(lambda: b.stats()["redis_pending_waits"] == 512, "the 512 waits", STATE_WAIT_S)
        with redis.Redis.from_url(redis_server.url) as direct:
            subscribers = [c for c in direct.client_list() if int(c["sub"]) > 0]
        assert len(subscribers) == 1 and int(subscribers[0]["sub"]) == 64  # one connection, one channel per id
        gate.set()
        assert await asyncio.gather(*waits) == [Settled.LANDED] * 512
        await asyncio.gather(*encodes)
        stats = b.stats()
        assert stats["redis_pending_wakeups"] == 512 and stats["redis_pending_channels"] == 0
        assert stats["redis_subscriber_connects"] == 1 and stats["redis_errors"] == 0


async def test_a_local_hit_that_redis_evicted_is_shared_again(redis_server):
    """Replica A serves an id from its own tier (an encode's local hit), which Redis's LRU never sees: Redis
    may evict it meanwhile. `share` puts it back, marked pending until the write lands, so B finds it."""
    async with replicas(redis_server.url) as (a, b):
        entry = make_entry(8)
        a.put("k", entry)
        await a.redis.flush()
        assert await a.share(["k"]) == 0  # still in Redis: only touched
        assert command_calls(redis_server.url, "touch") == 1
        with redis.Redis.from_url(redis_server.url) as direct:
            direct.delete("k", location_name("k"))  # evicted: the copy and the location
        assert await b.wait_for("k", 0) is Settled.NOT_PENDING  # B would answer 404
        assert await a.share(["k"]) == 1  # marked pending, written again behind
        assert await b.wait_for("k", LONG_S) is Settled.LANDED
        assert torch.equal(await b.read_rows("k", 0, 300), entry.tensor)
        assert a.stats()["reshared"] == 1
        local_only = Solo(EmbeddingStore(1 << 20))
        assert local_only.mark([], [make_key(b"k", "fp", "blake3")]) is None  # no Redis: nothing to share


async def test_a_local_hit_whose_write_is_on_its_way_is_not_written_twice(redis_server):
    async with replicas(redis_server.url) as (a, b):
        gate, write = asyncio.Event(), a.redis.writes._write

        async def held_write(key, entry, *args):  # the write-behind has not reached Redis yet
            await gate.wait()
            return await write(key, entry, *args)

        a.redis.writes._write = held_write
        a.put("k", make_entry(9))
        assert await a.share(["k"]) == 0  # not in Redis, but its write is queued: nothing to do
        gate.set()
        await a.redis.flush()
        assert a.stats()["redis_writes"] == 1 and a.stats()["reshared"] == 0


async def test_the_newest_images_bytes_are_kept_the_oldest_make_room(redis_server):
    """Image bytes stay in Redis for the lease, after the rows land too. Under load a replica's share of them
    fills up: before, every newer image went unkept, so the images most likely still unfetched were the ones
    no other replica could encode again should this one die (404s after a SIGKILL). Now the oldest make room."""
    async with replicas(redis_server.url, max_input_bytes=3000) as (a, b):
        for k in range(6):
            assert await a.mark_pending([f"k{k}"], inputs={f"k{k}": bytes([k]) * 1000})
            a.put(f"k{k}", make_entry(k))  # landed: the bytes stay
        await a.redis.flush()
        assert a.stats()["redis_inputs_pushed_out"] == 3 and a.stats()["redis_inputs_skipped"] == 0
        await a.mark_pending(["next"], inputs={"next": b"n" * 1000})  # pushes k3 out, deletes k0..k3 in Redis
        kept = [await b.input(f"k{k}") for k in range(6)]
        assert kept == [None] * 4 + [bytes([k]) * 1000 for k in (4, 5)] and await b.input("next") == b"n" * 1000


async def test_an_input_pushed_out_is_not_deleted_while_its_key_has_a_newer_one(redis_server):
    """A key claimed again (its image encoded again here after its entry went) sent newer bytes under the same
    name: pushing its older bytes out of the budget deletes nothing in Redis; pushing the newer out does."""
    async with replicas(redis_server.url, max_input_bytes=3000) as (a, b):
        assert await a.mark_pending(["k"], inputs={"k": b"o" * 1000})
        await a.mark_pending(["k"], inputs={"k": b"n" * 1000})  # claimed again: newer bytes, same name
        assert await b.input("k") == b"n" * 1000
        for k in range(2):  # x0 fills the budget; x1 pushes the older "k" bytes out (its write carries no DEL)
            assert await a.mark_pending([f"x{k}"], inputs={f"x{k}": bytes([k]) * 1000})
        assert a.stats()["redis_inputs_pushed_out"] == 1 and await b.input("k") == b"n" * 1000
        assert await a.mark_pending(["y"], inputs={"y": b"y" * 10})  # pushes the newer "k" out: its DEL
        assert a.stats()["redis_inputs_pushed_out"] == 2 and await b.input("k") is None
