"""Two replicas sharing a real distributed Redis on 127.0.0.1 (issue 39): a Redis Cluster of three masters with
a replica each, found from the URL of one node as given, and a Sentinel set (a master, its replica, three
Sentinels) named by a redis+sentinel:// URL.

  - Every id's names share one hash slot, ids spread over every master, and crossing fetches get exact rows.
  - A master SIGKILLed under a load of pairs (encode on one replica, fetch on the other, through the project's
    clients, which retry 503 within their timeout): no wrong rows, no 404, no failed fetch; afterwards every
    accepted image is served by every replica. A raw HTTP caller polling a crossing fetch meanwhile sees 200 or
    503 only, and 503 for at most 2 s past the moment Redis itself finished the failover.
  - /health/ready names the kind of Redis and each node's state.

Failure detection is faster here than redis_cluster.py's default (node timeout and down-after FAILOVER_DETECT_MS),
so that a failover fits a test, and not so fast that CPU starvation fails a node over mid-test; the bounds are
relative to Redis's own failover. redis_cluster.py builds the sets.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import redis
import torch

from encoder_service.client import AsyncEncoderClient
from tests.support.images import image_bytes
from tests.support.redis_cluster import RedisClusterSet, SentinelSet, slot_owners
from tests.support.redis_server import find_redis7, find_redis_server, major_version
from tests.support.stores import make_entry, open_store
from tests.support.replica_load import Load
from tests.support.service import RunningService, running

pytestmark = pytest.mark.timeout(240)

PAIRS = {"before": 16, "failover": 24, "after": 16}
FETCH_TIMEOUT_S = 20.0  # each call's deadline: the clients retry inside it
FAILOVER_S = 30.0  # bound on Redis's own failover here
PAST_FAILOVER_S = 2.0  # what the service may add to Redis's failover, as raw callers see it
FAILOVER_DETECT_MS = 2000  # the Cluster's node timeout, the Sentinels' down-after


@pytest.fixture(scope="module")
def cluster():
    redis_set = RedisClusterSet(masters=3, replicas=1, node_timeout_ms=FAILOVER_DETECT_MS).start()
    yield redis_set
    redis_set.stop()


@pytest.fixture(scope="module")
def sentinels():
    redis_set = SentinelSet(replicas=1, sentinels=3, down_after_ms=FAILOVER_DETECT_MS).start()
    yield redis_set
    redis_set.stop()


def pair(request, tiny_checkpoint, url: str) -> tuple[RunningService, RunningService]:
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    return running(request, checkpoint, "--redis-url", url), running(request, checkpoint, "--redis-url", url)


def ready(svc: RunningService) -> dict:
    with httpx.Client(timeout=10) as http:
        return http.get(f"{svc.url}/health/ready").json()


class RawPoller:
    """A raw HTTP caller (no retries) fetching ids that `encoder` holds from `other`, every 50 ms in a thread:
    (seconds since start, status) of each answer."""

    def __init__(self, other: RunningService, ids: list[tuple[str, int]]):
        self.url, self.ids = f"{other.url}/v1/fetch", ids
        self.answers: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> RawPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as http:
            k = 0
            while not self._stop.wait(0.05):
                id_, n = self.ids[k % len(self.ids)]
                k += 1
                body = {"items": [{"id": id_, "offset": 0}], "start": 0, "end": n, "timeout_s": 5}
                try:
                    status = http.post(self.url, json=body).status_code
                except httpx.HTTPError:
                    status = -1
                self.answers.append((time.monotonic() - self.t0, status))

    def unavailable_window(self) -> tuple[float, float] | None:
        """(first, last) time of a 503, or None."""
        times = [t for t, status in self.answers if status == 503]
        return (times[0], times[-1]) if times else None


def failover_under_load(replicas, kill, promoted) -> None:
    """The load's phases around a master's SIGKILL (`kill()`; `promoted()` returns once Redis has failed over),
    a raw caller polling meanwhile; asserts the issue's bar."""
    load = Load(replicas, PAIRS, concurrency=8)
    clients = []

    async def phase(name: str) -> None:
        await load.run(name, clients)

    async def scenario() -> tuple[RawPoller, float, float]:
        clients[:] = [AsyncEncoderClient.http(r.url, timeout=FETCH_TIMEOUT_S) for r in replicas]
        try:
            await phase("before")
            on_a = [(id_, n) for id_, (n, _) in load.encoded.items() if load.encoded_by[id_] == 0]
            with RawPoller(replicas[1], on_a) as poller:  # ids A holds, asked of B: crossing fetches
                await asyncio.sleep(0.5)
                killed_at = time.monotonic() - poller.t0
                await asyncio.to_thread(kill)
                during = asyncio.create_task(phase("failover"))
                await asyncio.to_thread(promoted)
                promoted_at = time.monotonic() - poller.t0
                await during
                await phase("after")
                await asyncio.sleep(PAST_FAILOVER_S + 0.5)
            # Every accepted image, from every replica.
            for client in clients:
                for id_, (n, own) in load.encoded.items():
                    rows = (await client.fetch([(id_, 0)], 0, n)).rows
                    load.wrong_rows += not torch.equal(rows, own)
            return poller, killed_at, promoted_at
        finally:
            for client in clients:
                await client.close()

    poller, killed_at, promoted_at = asyncio.run(scenario())
    window = poller.unavailable_window()
    print(f"\nkilled at {killed_at:.2f}s, Redis failed over at {promoted_at:.2f}s; raw 503s: {window}; "
          f"cross fetches: " + "; ".join(f"{p}: {dict(c)}" for p, c in load.outcomes.items()))
    assert load.local_failures == [] and load.wrong_rows == 0
    assert {p: dict(c) for p, c in load.outcomes.items()} == {p: {"ok": n} for p, n in PAIRS.items()}
    assert len(load.encoded) == sum(PAIRS.values())
    assert {status for _, status in poller.answers} <= {200, 503}, poller.answers
    if window is not None:
        assert window[1] <= promoted_at + PAST_FAILOVER_S, (window, promoted_at)
    assert [ready(r)["redis"] for r in replicas] == ["up", "up"]


# ---- Redis Cluster ------------------------------------------------------------------------------------------
def test_a_cluster_named_by_one_node_spreads_ids_over_every_master(request, tiny_checkpoint, cluster):
    a, b = pair(request, tiny_checkpoint, cluster.url)
    detail = ready(a)["redis_detail"]
    assert detail["mode"] == "cluster" and detail["state"] == "up"
    assert detail["pubsub"] == ("sharded" if major_version(cluster.binary) >= 7 else "plain")
    assert sorted(detail["nodes"]) == sorted(m.address for m in cluster.live_masters())
    before = slot_owners(cluster)

    async def crossing() -> int:
        async with AsyncEncoderClient.http(a.url, timeout=FETCH_TIMEOUT_S) as on_a, \
                AsyncEncoderClient.http(b.url, timeout=FETCH_TIMEOUT_S) as on_b:
            infos = [i for k in range(0, 24, 6) for i in await on_a.encode(
                [image_bytes(64, 48, seed=4100 + k + j) for j in range(6)], wait=True)]
            wrong = 0
            for info in infos:
                own = (await on_a.fetch([(info.id, 0)], 0, info.num_tokens)).rows
                wrong += not torch.equal((await on_b.fetch([(info.id, 0)], 0, info.num_tokens)).rows, own)
            return wrong

    assert asyncio.run(crossing()) == 0
    after = slot_owners(cluster)
    assert all(after[m] > before.get(m, 0) for m in after), (before, after)  # every master took keys
    for svc in (a, b):
        assert svc.sample("encoder_cache_redis_error_replies_total") in (None, 0.0)
        assert svc.sample("encoder_cache_redis_dropped_writes_total", {"reason": "failed"}) == 0


def test_a_cluster_master_killed_under_load(request, tiny_checkpoint, cluster):
    replicas = pair(request, tiny_checkpoint, cluster.url)
    failover_under_load(replicas, lambda: cluster.kill_master(0), lambda: cluster.wait_promoted(FAILOVER_S))


# ---- Sentinel ------------------------------------------------------------------------------------------------
def test_a_sentinel_master_killed_under_load(request, tiny_checkpoint, sentinels):
    replicas = pair(request, tiny_checkpoint, sentinels.url)
    detail = ready(replicas[0])["redis_detail"]
    assert detail == {"mode": "sentinel", "state": "up", "nodes": {sentinels.master().address: "up"},
                      "pubsub": "plain"}
    old = sentinels.master()
    failover_under_load(replicas, sentinels.kill_master, lambda: sentinels.wait_promoted(old, FAILOVER_S))
    new = sentinels.master()
    assert ready(replicas[0])["redis_detail"]["nodes"] == {new.address: "up"}
    with redis.Redis(host="127.0.0.1", port=new.port) as direct:
        assert direct.dbsize() > 0


# ---- how a claim's outcome travels on a Cluster ---------------------------------------------------------------
@pytest.mark.parametrize("version", ["6", "7"])
def test_waits_on_a_cluster_are_woken_by_plain_or_sharded_pub_sub(version):
    """Redis >= 7: SPUBLISH to the master of the marker's slot, each waiter subscribed there (no message over
    the cluster bus); 6.2 (no sharded pub/sub): plain PUBLISH, one subscriber connection, broadcast."""
    binary = find_redis7() if version == "7" else find_redis_server()
    if major_version(binary) != int(version):
        pytest.skip(f"no redis-server {version} here")
    cluster = RedisClusterSet(masters=3, replicas=0, binary=binary).start()

    async def scenario() -> dict[str, int]:
        a, b = await open_store(cluster.url), await open_store(cluster.url)
        try:
            keys = [f"encsvc:fp:{{c:blake3:{k:032x}}}" for k in range(9)]
            assert (await a.mark_pending(keys)).ok
            waits = [asyncio.create_task(b.wait_for(key, 20)) for key in keys]
            while b.stats()["redis_pending_waits"] < len(keys):
                await asyncio.sleep(0.05)
            for key in keys:
                a.put(key, make_entry(1, num_rows=8))
            return {str(s) for s in await asyncio.gather(*waits)}, b.redis.describe()["pubsub"]
        finally:
            await a.close()
            await b.close()

    try:
        outcomes, pubsub = asyncio.run(scenario())
        calls = {}
        for master in cluster.live_masters():
            with master.client() as client:
                for name, stat in client.info("commandstats").items():
                    calls[name] = calls.get(name, 0) + stat["calls"]
    finally:
        cluster.stop()
    assert outcomes == {"Settled.LANDED"}
    if version == "7":
        assert pubsub == "sharded" and calls.get("cmdstat_spublish", 0) >= 9 and "cmdstat_publish" not in calls
    else:
        assert pubsub == "plain" and calls.get("cmdstat_publish", 0) >= 9 and "cmdstat_spublish" not in calls
