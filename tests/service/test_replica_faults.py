"""Faults across replicas sharing one real redis-server (issues 13 and 22), each bounded in time:

  - Redis killed and restarted on the same port (empty), or paused (SIGSTOP), for 2-3 s while two
    replicas serve a bounded load of pairs: encode an image (no wait) on one replica, fetch its rows on the
    other (the cross-replica fetch under test) and on the encoding one (its own rows, from its local tier:
    the reference). The callers are the project's clients, which retry 503 / UNAVAILABLE within their
    timeout: they see no error in any phase (before, during, after the outage), never a wrong row, and once
    the outage is over every id encoded in any phase is fetchable from every replica (rows finished during
    the outage wait in a backlog and are written once Redis is back; ids leased before it are written again
    into the restarted, empty Redis).
  - A replica process SIGKILLed mid-encode (two `encoder-service serve` processes): every fetch of the image
    it accepted, waiting on the other replica before the kill (HTTP without timeout_s, gRPC without a
    deadline) or sent after it, is answered within KILL_BOUND_S of the kill, with the right rows: the other
    replica learns within the marker's TTL that the owner is gone and encodes the image from the bytes it
    kept in Redis.
  - Redis paused for 5 s while a replica encodes an image another one's fetch waits for: the fetch, and a
    later one, are answered once Redis is back (the rows, finished during the pause, are written then).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import torch

from encoder_service.cache import key_from_id
from encoder_service.replicas.directory import is_pending, marker_name
from encoder_service.replicas import RedisOptions
from encoder_service.client import AsyncEncoderClient, EncoderClient
from tests.support.encoder_process import Replica, started
from tests.support.images import image_bytes, png_with_text
from tests.support.redis_server import RedisServer
from tests.support.replica_load import Load
from tests.support.reference import assert_close, reference_rows
from tests.support.service import RunningService, held_decode, running
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(180)

PAIRS = {"before": 32, "outage": 32, "after": 32}
OUTAGE_S = {"kill": 2.0, "pause": 5.0}  # a pause must outlast the 2 s socket timeout to be an outage
PROBE_INTERVAL_S = RedisOptions.probe_max_s  # the service's (no flag changes it)
FETCH_TIMEOUT_S = 15.0  # each call's deadline: the clients retry inside it
KILL_BOUND_S = 10.0
WAIT_S = 30.0
PENDING_WAITS = "encoder_cache_redis_pending_waits_total"  # B's fetches asleep on a marker of A's


def redis_state(svc: RunningService) -> str:
    """What /health/ready says of Redis, read on the service's loop."""

    async def state() -> str:
        return svc.core.readiness()["redis"]

    return svc.call(state)


@pytest.mark.parametrize("outage", ["kill", "pause"])
def test_a_redis_outage_under_load_is_invisible_to_callers(request, tiny_checkpoint, redis_server, outage):
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    replicas = (running(request, checkpoint, "--redis-url", redis_server.url),
                running(request, checkpoint, "--redis-url", redis_server.url))
    load = Load(replicas, PAIRS)

    async def over_after(seconds: float) -> None:
        await asyncio.sleep(seconds)
        if outage == "kill":
            await asyncio.to_thread(redis_server.start)  # same port, empty (persistence is off)
        else:
            redis_server.resume()

    async def scenario() -> None:
        clients = [AsyncEncoderClient.http(r.url, timeout=FETCH_TIMEOUT_S) if k == 0 else
                   AsyncEncoderClient.grpc(r.grpc_address, timeout=FETCH_TIMEOUT_S) for k, r in enumerate(replicas)]
        try:
            await load.run("before", clients)
            if outage == "kill":
                redis_server.kill()
            else:
                redis_server.pause()
            ending = asyncio.create_task(over_after(OUTAGE_S[outage]))
            await load.run("outage", clients)  # during the outage, and past it: its calls retry meanwhile
            await ending
            await load.run("after", clients)
            assert [redis_state(r) for r in replicas] == ["up", "up"]
            # Every id of every phase, from every replica.
            for client in clients:
                for id_, (n, own) in load.encoded.items():
                    rows = (await client.fetch([(id_, 0)], 0, n)).rows
                    load.wrong_rows += not torch.equal(rows, own)
        finally:
            for client in clients:
                await client.close()

    t0 = time.monotonic()
    asyncio.run(scenario())
    print(f"\n{sum(PAIRS.values())} pairs in {time.monotonic() - t0:.1f}s; cross-replica fetches by phase: "
          + "; ".join(f"{p}: {dict(c)}" for p, c in load.outcomes.items()))
    assert load.local_failures == []  # the encoding replica serves its own ids throughout
    assert {phase: dict(c) for phase, c in load.outcomes.items()} == {p: {"ok": n} for p, n in PAIRS.items()}
    assert len(load.encoded) == sum(PAIRS.values()) and load.wrong_rows == 0
    down = [r.sample("encoder_cache_redis_down_events_total") for r in replicas]
    assert min(down) >= 1  # both saw the outage (it was no outage to them otherwise)


# ---- a replica killed mid-encode -------------------------------------------------------------------------
def entry_state(url: str, fingerprint: str, id_: str) -> tuple[bool, bytes | None]:
    """(whether the id's rows are in Redis, its marker's value)."""
    name = key_from_id(id_, fingerprint).name
    with redis.Redis.from_url(url) as direct:
        return bool(direct.exists(name)), direct.get(marker_name(name))


@pytest.fixture
def roomy_redis():
    """Room for the kept image bytes of a replica's backlog (what the 8 MB default server would evict)."""
    server = RedisServer(maxmemory="1gb", policy="allkeys-lru").start()
    yield server
    server.stop()


def test_a_replica_killed_mid_encode_leaves_no_fetch_hanging(tmp_path, tiny_checkpoint, roomy_redis):
    redis_server = roomy_redis
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    limits = ("--max-body-bytes", "128MiB", "--max-image-bytes", "16MiB")
    with started(Replica("a", checkpoint, redis_server.url, tmp_path, *limits),
                 Replica("b", checkpoint, redis_server.url, tmp_path, *limits)) as (a, b), \
            EncoderClient.http(a.url, timeout=WAIT_S) as on_a, ThreadPoolExecutor(4) as pool:
        fingerprint = on_a.metadata()["fingerprint"]
        big = image_bytes(1600, 1200, seed=7)  # tens of ms to decode: A has a backlog of them ahead of the target
        for k in range(0, 32, 16):
            on_a.encode([png_with_text(big, n) for n in range(k, k + 16)])
        target = png_with_text(big, 1000)
        (info,) = on_a.encode([target])
        os.kill(a.proc.pid, signal.SIGSTOP)  # frozen mid-encode: nothing of the target lands from here on
        try:
            landed, marker = entry_state(redis_server.url, fingerprint, info.id)
            assert not landed and is_pending(marker), "A finished before it was stopped: give it a longer backlog"
            def pending_waits() -> float:
                return b.metrics((PENDING_WAITS,)).get(PENDING_WAITS, 0)

            waits = pending_waits()
            # Waiting on B before the kill: HTTP without timeout_s, gRPC without a deadline.
            http_b, grpc_b = EncoderClient.http(b.url, timeout=None), EncoderClient.grpc(b.grpc_address, timeout=None)
            waiting = [pool.submit(c.fetch, [(info.id, 0)], 0, info.num_tokens) for c in (http_b, grpc_b)]
            wait_for(lambda: any(f.done() for f in waiting) or pending_waits() >= waits + 2, "B's two fetches to wait",
                     WAIT_S, poll_s=0.05)
            assert not any(f.done() for f in waiting), [f.result() for f in waiting if f.done()]
        finally:
            os.kill(a.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        later = pool.submit(http_b.fetch, [(info.id, 0)], 0, info.num_tokens)  # sent after the kill
        results = [f.result(timeout=KILL_BOUND_S) for f in (*waiting, later)]
        answered_in = time.monotonic() - killed
        http_b.close()
        grpc_b.close()
    assert answered_in < KILL_BOUND_S
    expected = reference_rows(checkpoint, target)
    for result in results:
        assert_close(result.rows, expected)
    print(f"\nevery fetch answered {answered_in:.2f} s after the kill")


# ---- Redis paused while a replica encodes ----------------------------------------------------------------
def test_redis_paused_during_an_encode_another_replica_waits_for(request, tiny_checkpoint, redis_server):
    """Before: A's rows, finished while Redis stalled, were dropped, and B's fetch hung for the whole lease
    (299 s). Now they wait in A's backlog, and B's fetches (the project's client, which retries the 503s of
    B's own outage) get them once Redis answers again."""
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    a = running(request, checkpoint, "--redis-url", redis_server.url)
    b = running(request, checkpoint, "--redis-url", redis_server.url)
    data = image_bytes(96, 64, seed=4242)
    with held_decode(a, WAIT_S) as gate, EncoderClient.http(a.url, timeout=WAIT_S) as on_a, \
            EncoderClient.grpc(b.grpc_address, timeout=WAIT_S) as on_b, ThreadPoolExecutor(2) as pool:
        (info,) = on_a.encode([data])
        waits = b.sample(PENDING_WAITS)
        waiting = pool.submit(on_b.fetch, [(info.id, 0)], 0, info.num_tokens)
        wait_for(lambda: b.sample(PENDING_WAITS) != waits, "B's fetch to wait", WAIT_S, poll_s=0.02)
        encoded = a.sample("encoder_images_encoded_total")
        redis_server.pause()
        try:
            gate.set()  # A's encode finishes while Redis does not answer: its write goes to the backlog
            wait_for(lambda: a.sample("encoder_images_encoded_total") > encoded and redis_state(a) != "up",
                     "A's encode done and its Redis tier down", WAIT_S, poll_s=0.05)
        finally:
            redis_server.resume()
        resumed = time.monotonic()
        later = pool.submit(on_b.fetch, [(info.id, 0)], 0, info.num_tokens)
        rows = [f.result(timeout=KILL_BOUND_S).rows for f in (waiting, later)]
        answered_in = time.monotonic() - resumed
        own = on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows
    assert answered_in < KILL_BOUND_S
    assert all(torch.equal(r, own) for r in rows)
    assert a.sample("encoder_cache_redis_backlog_writes_total") >= 1  # written after the pause, not dropped


# ---- Redis restarted while a replica is idle --------------------------------------------------------------
def test_a_replica_idle_while_redis_restarts_writes_its_leased_ids_again(request, tiny_checkpoint, redis_server):
    """Before: an idle replica's first command after a restart succeeded on a fresh connection, so it counted no
    outage and never wrote its leased ids again: other replicas answered 404 for them for good. Its heartbeat
    now sees Redis's run id change."""
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    a = running(request, checkpoint, "--redis-url", redis_server.url)
    b = running(request, checkpoint, "--redis-url", redis_server.url)
    with EncoderClient.http(a.url, timeout=WAIT_S) as on_a, EncoderClient.http(b.url, timeout=WAIT_S) as on_b:
        infos = on_a.encode([image_bytes(64, 48, seed=9100 + k) for k in range(4)], wait=True)
        own = [on_a.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
        wait_for(lambda: a.sample("encoder_cache_redis_writes_total") >= 4, "A's rows written to Redis", WAIT_S)
        redis_server.kill()
        redis_server.start()  # same port, empty; A sends nothing meanwhile
        # Seen as a changed run id, or as an outage when a heartbeat fell between the kill and the start.
        wait_for(lambda: a.sample("encoder_cache_redis_restarts_seen_total")
                 + a.sample("encoder_cache_redis_down_events_total") >= 1, "A to see the restart", WAIT_S)
        rows = [on_b.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]  # the client retries B's 503s
    assert all(torch.equal(r, o) for r, o in zip(rows, own))


def test_ids_released_but_still_held_are_announced_again_after_a_redis_restart(request, tiny_checkpoint,
                                                                               redis_server):
    """Before: only leased ids were written again after a restart, so ids a client had fetched and released
    (still in A's LRU) were known to A alone, and B answered 404 for them. A now announces every id it holds
    again, at a bounded rate."""
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    a = running(request, checkpoint, "--redis-url", redis_server.url)
    b = running(request, checkpoint, "--redis-url", redis_server.url)
    with EncoderClient.http(a.url, timeout=WAIT_S) as on_a, EncoderClient.http(b.url, timeout=WAIT_S) as on_b:
        infos = [info for k in (0, 6) for info in on_a.encode(
            [image_bytes(64, 48, seed=9200 + k + j) for j in range(6)], wait=True)]
        own = [on_a.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
        on_a.release([i.id for i in infos])

        async def leased() -> list[str]:
            return a.core.store.local.leased_keys()

        assert a.call(leased) == []  # held here, no longer leased
        wait_for(lambda: a.sample("encoder_cache_redis_writes_total") >= 12, "A's rows written to Redis", WAIT_S)
        redis_server.restart()
        wait_for(lambda: a.sample("encoder_cache_redis_restarts_seen_total")
                 + a.sample("encoder_cache_redis_down_events_total") >= 1, "A to see the restart", WAIT_S)
        rows = [on_b.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]  # the client retries B's 503s
    assert all(torch.equal(r, o) for r, o in zip(rows, own))


# ---- the replica holding landed rows SIGKILLed -----------------------------------------------------------
def test_the_owner_of_landed_rows_killed_its_ids_are_encoded_again_elsewhere(tmp_path, tiny_checkpoint, roomy_redis):
    """The rows stay on the replica that made them; should it die, any replica still answers every id it had
    accepted: from the image bytes kept in Redis, once across replicas, with exact rows. A's 24 images have
    landed (wait=true) when it is killed; B and C are asked for all of them at once."""
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    datas = [image_bytes(64, 48, seed=9300 + k) for k in range(24)]
    with started(*(Replica(n, checkpoint, roomy_redis.url, tmp_path) for n in "abc")) as (a, b, c), \
            EncoderClient.http(a.url, timeout=WAIT_S) as on_a:
        infos = on_a.encode(datas[:12], wait=True) + on_a.encode(datas[12:], wait=True)
        os.kill(a.proc.pid, signal.SIGKILL)
        killed = time.monotonic()

        async def fetch_all() -> list:
            async with AsyncEncoderClient.http(b.url, timeout=WAIT_S) as on_b, \
                    AsyncEncoderClient.grpc(c.grpc_address, timeout=WAIT_S) as on_c:
                return await asyncio.gather(*(client.fetch([(i.id, 0)], 0, i.num_tokens)
                                              for i in infos for client in (on_b, on_c)))

        got = asyncio.run(fetch_all())
        answered_in = time.monotonic() - killed
        encoded = sum(r.metrics(("encoder_images_encoded_total",))["encoder_images_encoded_total"] for r in (b, c))
    assert answered_in < KILL_BOUND_S
    for k, info in enumerate(infos):
        expected = reference_rows(checkpoint, datas[k])
        for fetched in got[2 * k:2 * k + 2]:
            assert_close(fetched.rows, expected)
    assert encoded == len(infos)  # once each, across B and C
    print(f"\n{len(infos)} ids answered by B and C {answered_in:.2f} s after their owner's kill")
