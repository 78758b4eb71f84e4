"""Two real replicas on loopback sharing one real redis-server, as behind one Kubernetes Service: each is the
whole service (core + HTTP + gRPC). Redis holds the directory (who holds which id), the claims and the
image bytes; the rows stay on the replica that made them and travel replica to replica over its HTTP row
path (replicas/peers.py). An LLM server's encode reaches replica A and its fetch of the same id reaches B:

  - B's fetch, made while A's encode is still running, waits (on Redis pub/sub, replicas/shared.py) and gets
    A's rows bit for bit once they land, fetched from A: over HTTP, and over gRPC;
  - A's encode failing (a JPEG cut short: its header is fine, its decode fails in A's engine) gives B that
    400, not a 404;
  - an id nobody encoded is a 404 on B at once;
  - 128 concurrent fetches on B of ids only A holds all succeed, from A (B passes them on, keeps none);
  - a Redis far too small for the rows (2 MB, no eviction) holds the directory and the fetches all work;
  - a Redis behind a 16 KB/s link: the rows cross replica to replica all the same;
  - an id A serves from its own tier after Redis evicted its location is written there again by A's encode;
  - fetches of ids A has in flight or locally send Redis nothing;
  - a new image sent to both replicas at once is encoded once (issue 22 item 4): one claims it, the other
    waits for its rows.

A's engine is held at its decode step (`held_decode`) so that "still running" is deterministic, and B's
`encoder_cache_redis_pending_waits_total` proves its fetch was waiting before A's rows existed.
"""

from __future__ import annotations

import asyncio
import io
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import torch
from PIL import Image

from encoder_service import errors
from encoder_service.cache import key_from_id
from encoder_service.replicas.directory import location_name
from encoder_service.client import AsyncEncoderClient
from tests.support.clients import sync_client
from tests.support.forwarder import Forwarder
from tests.support.images import image_bytes, truncated_jpeg
from tests.support.service import RunningService, held_decode, running
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30  # bound on every wait in this file
PENDING_WAITS = "encoder_cache_redis_pending_waits_total"


@pytest.fixture(scope="module")
def replicas(request, tiny_checkpoint, shared_redis) -> tuple[RunningService, RunningService]:
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    return (running(request, checkpoint, "--redis-url", shared_redis.url),
            running(request, checkpoint, "--redis-url", shared_redis.url))


def name_of(svc: RunningService, id_: str) -> str:
    return key_from_id(id_, svc.core.model_fp, svc.core.settings.cache.hash).name


def located(url: str, svc: RunningService, id_: str) -> bool:
    """Whether Redis's directory says where the id's rows are."""
    with redis.Redis.from_url(url) as direct:
        return bool(direct.exists(location_name(name_of(svc, id_))))


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_fetch_on_b_waits_for_the_encode_still_running_on_a(replicas, shared_redis, transport):
    a, b = replicas
    data = image_bytes(112, 84, seed=1 if transport == "http" else 2)
    misses = b.sample("encoder_cache_misses_total")
    with held_decode(a, WAIT_S) as gate, sync_client(a, transport) as on_a, sync_client(b, transport) as on_b, \
            ThreadPoolExecutor(1) as pool:
        (info,) = on_a.encode([data])  # answered at once; A's engine holds the image
        waits = b.sample(PENDING_WAITS)
        fetching = pool.submit(on_b.fetch, [(info.id, 0)], 0, info.num_tokens)
        wait_for(lambda: b.sample(PENDING_WAITS) > waits, "B's fetch to sleep on its subscription", WAIT_S)
        name = name_of(a, info.id)
        assert name in a.core.flights and not located(shared_redis.url, a, info.id)  # while A's encode runs on
        assert not fetching.done()
        peer_hits = b.sample("encoder_cache_hits_total", {"tier": "peer"})
        gate.set()
        from_b = fetching.result(WAIT_S).rows
        from_a = on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows
    assert from_b.shape == (info.num_tokens, info.row_width)
    assert torch.equal(from_b, from_a)  # A's rows, bit for bit
    assert b.sample("encoder_cache_misses_total") == misses  # not encoded on B: fetched from A
    assert b.sample("encoder_cache_hits_total", {"tier": "peer"}) == peer_hits + 1


def test_timeout_zero_on_b_answers_at_once_while_a_encodes(replicas):
    a, b = replicas
    with held_decode(a, WAIT_S) as gate, httpx.Client(base_url=a.url, timeout=WAIT_S) as on_a, \
            httpx.Client(base_url=b.url, timeout=WAIT_S) as on_b:
        r = on_a.post("/v1/encode", content=image_bytes(64, 64, seed=7), headers={"content-type": "image/png"})
        info = r.json()["images"][0]
        body = {"items": [{"id": info["id"], "offset": 0}], "start": 0, "end": info["num_tokens"]}
        t0 = time.monotonic()
        r = on_b.post("/v1/fetch", json=body | {"timeout_s": 0})
        assert r.status_code == 504 and "still encoding on another replica" in r.json()["error"]["message"]
        r = on_b.post("/v1/fetch", json=body | {"timeout_s": 0.3})  # one timeout over the wait and the reads
        assert r.status_code == 504 and "within timeout_s=0.3" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5
        gate.set()
        assert on_b.post("/v1/fetch", json=body | {"timeout_s": WAIT_S}).status_code == 200


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_failed_encode_on_a_is_its_error_on_b_not_404(replicas, transport):
    a, b = replicas
    with held_decode(a, WAIT_S) as gate, sync_client(a, transport) as on_a, sync_client(b, transport) as on_b, \
            ThreadPoolExecutor(1) as pool:
        (info,) = on_a.encode([truncated_jpeg(seed=3 if transport == "http" else 4)])  # the header reads fine
        waits = b.sample(PENDING_WAITS)
        fetching = pool.submit(on_b.fetch, [(info.id, 0)], 0, info.num_tokens)
        wait_for(lambda: b.sample(PENDING_WAITS) > waits, "B's fetch to wait", WAIT_S)
        gate.set()  # A decodes now, and fails
        with pytest.raises(errors.InvalidInput) as failed:
            fetching.result(WAIT_S)
    assert "failed on another replica" in str(failed.value)
    assert getattr(failed.value.status, "name", failed.value.status) in (400, "INVALID_ARGUMENT")
    with sync_client(b, transport) as on_b:  # a fetch arriving later reads the failure from the marker
        with pytest.raises(errors.InvalidInput):
            on_b.fetch([(info.id, 0)], 0, info.num_tokens)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_an_id_nobody_encoded_is_404_on_b_at_once(replicas, transport):
    _, b = replicas
    with sync_client(b, transport) as on_b:
        t0 = time.monotonic()
        with pytest.raises(errors.NotFound, match="no live replica is encoding it"):
            on_b.fetch([("ab" * 16, 0)], 0, 4)
        assert time.monotonic() - t0 < 10  # at once, not after the client's timeout


def test_128_concurrent_fetches_of_ids_only_a_holds(replicas, shared_redis):
    a, b = replicas
    datas = [image_bytes(64, 48, seed=1000 + k) for k in range(128)]
    with sync_client(a, "http") as on_a:
        infos = [info for k in range(0, 128, 8) for info in on_a.encode(datas[k:k + 8], wait=True)]
        expected = {info.id: on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows for info in infos}
    a.call(a.core.replicas.redis.flush)  # A's write-behind has landed: the directory knows
    names = [name_of(b, i.id) for i in infos]
    assert all(b.core.store.peek(n) is None for n in names)  # B has none of them locally
    with redis.Redis.from_url(shared_redis.url) as direct:
        assert not any(direct.exists(n) for n in names)  # and Redis has none of their rows: only where they are
    hits = b.sample("encoder_cache_hits_total", {"tier": "peer"})

    async def fetch_all() -> list:
        async with AsyncEncoderClient.http(b.url, timeout=WAIT_S, limits=httpx.Limits(max_connections=128)) as on_b:
            return await asyncio.gather(*(on_b.fetch([(i.id, 0)], 0, i.num_tokens) for i in infos),
                                        return_exceptions=True)

    got = asyncio.run(fetch_all())
    failures = [g for g in got if isinstance(g, BaseException)]
    assert not failures, failures[:3]
    assert all(torch.equal(g.rows, expected[i.id]) for g, i in zip(got, infos))
    assert b.sample("encoder_cache_hits_total", {"tier": "peer"}) - hits == 128
    assert all(b.core.store.peek(n) is None for n in names)  # passed on, not kept: the rows stay on A


def test_a_redis_far_too_small_for_the_rows_holds_the_directory(request, tiny_checkpoint, redis_server_noevict):
    """Before, every row crossing replicas went through Redis: a Redis smaller than the rows refused them (or
    evicted them), and the other replica answered 404. Now it holds only what is small: with room for a
    third of the rows (no eviction), every cross-replica fetch gets them, and no id is failed. (Qwen3-VL: wide
    rows, with deepstack.)"""
    checkpoint = tiny_checkpoint("qwen3_vl")
    a = running(request, checkpoint, "--redis-url", redis_server_noevict.url)
    b = running(request, checkpoint, "--redis-url", redis_server_noevict.url)
    datas = [image_bytes(448, 448, seed=4100 + k, fmt="JPEG") for k in range(80)]
    room = 1 << 20  # the replicas' connections take some of it too (their buffers count against maxmemory)
    with redis.Redis.from_url(redis_server_noevict.url) as direct:
        direct.config_set("maxmemory", str(direct.info("memory")["used_memory"] + room))
    with sync_client(a, "http") as on_a, sync_client(b, "grpc") as on_b:
        infos = [info for k in range(0, 80, 8) for info in on_a.encode(datas[k:k + 8], wait=True)]
        own = [on_a.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
        a.call(a.core.replicas.redis.flush)
        crossed = [on_b.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
    assert sum(r.numel() * r.element_size() for r in own) > 3 * room
    assert all(torch.equal(x, y) for x, y in zip(crossed, own))
    assert a.sample("encoder_cache_redis_dropped_writes_total", {"reason": "failed"}) == 0


def flat_png(size: int, k: int) -> bytes:
    """A one-colour PNG: a few hundred bytes of input for a tiny tower's most rows (64 tokens)."""
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (k * 37 % 256, k * 91 % 256, 200)).save(buf, "PNG")
    return buf.getvalue()


def test_a_redis_slower_than_the_rows_does_not_slow_a_cross_replica_fetch(request, tiny_checkpoint, shared_redis):
    """Both replicas reach Redis over a link of 16 KB/s each way (tests/support/forwarder.py): the claims, the
    image bytes and the directory cross it; the rows, several times what that link carries within the fetches'
    timeout, reach B from A over A's row path. Through Redis they could not have."""
    rate = 16_000
    host, port = shared_redis.url.removeprefix("redis://").split("/")[0].split(":")
    slow = Forwarder([(host, int(port))], rate=rate)
    request.addfinalizer(slow.close)
    slow_url = slow.url.replace("http://", "redis://") + "/0"
    checkpoint = tiny_checkpoint("qwen3_vl")
    a = running(request, checkpoint, "--redis-url", slow_url)
    b = running(request, checkpoint, "--redis-url", slow_url)
    datas = [flat_png(256, k) for k in range(40)]
    with sync_client(a, "http") as on_a, sync_client(b, "http") as on_b:  # each call times out after WAIT_S
        infos = [info for k in range(0, 40, 8) for info in on_a.encode(datas[k:k + 8], wait=True)]
        own = [on_a.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
        hits = b.sample("encoder_cache_hits_total", {"tier": "peer"})
        crossed = [on_b.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
    assert sum(r.numel() * r.element_size() for r in own) > 2 * rate * WAIT_S
    assert all(torch.equal(x, y) for x, y in zip(crossed, own))
    assert b.sample("encoder_cache_hits_total", {"tier": "peer"}) - hits == len(infos)
    with redis.Redis.from_url(slow_url) as through_the_link:  # the link is as slow as said
        t0 = time.monotonic()
        through_the_link.set("encsvc:test:slow-link", bytes(rate))
        assert time.monotonic() - t0 >= 0.9


def test_an_id_a_serves_locally_but_redis_evicted_is_fetched_on_b(replicas, shared_redis):
    """A's encode of an id it has in its own tier (a local hit) sends Redis no read, so Redis's LRU may evict
    the id's location while A keeps using it: that encode writes it to Redis again, and B's fetch gets it."""
    a, b = replicas
    data = image_bytes(96, 96, seed=77)
    with sync_client(a, "http") as on_a, sync_client(b, "http") as on_b:
        (info,) = on_a.encode([data], wait=True)
        a.call(a.core.replicas.redis.flush)
        with redis.Redis.from_url(shared_redis.url) as direct:
            assert direct.delete(location_name(name_of(a, info.id))) == 1  # evicted from Redis; A still has it
        (again,) = on_a.encode([data])
        assert again.cached
        rows = on_b.fetch([(info.id, 0)], 0, info.num_tokens).rows
        assert torch.equal(rows, on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows)
    assert a.sample("encoder_cache_reshared_total") == 1


def test_fetching_local_ids_sends_redis_nothing(replicas, shared_redis):
    """No header read and no wait for ids in flight or in the local tier: the hot path stays off Redis."""
    a, _ = replicas
    with sync_client(a, "http") as on_a, redis.Redis.from_url(shared_redis.url) as direct:
        (info,) = on_a.encode([image_bytes(64, 64, seed=2024)], wait=True)
        a.call(a.core.replicas.redis.flush)
        before = direct.info("stats")["total_commands_processed"]
        for _ in range(5):
            on_a.fetch([(info.id, 0)], 0, info.num_tokens)
        assert direct.info("stats")["total_commands_processed"] == before + 1  # only that INFO itself


def test_an_image_sent_to_both_replicas_at_once_is_encoded_once(replicas):
    """Before, both replicas encoded it (74-79 encodes per 40 images measured): the claim (SET NX of the
    pending marker) lets one encode it, and the other answers with its rows."""
    a, b = replicas
    datas = [image_bytes(80, 64, seed=3000 + k) for k in range(24)]
    before = [r.sample("encoder_images_encoded_total") for r in replicas]

    async def race() -> list:
        async with AsyncEncoderClient.http(a.url, timeout=WAIT_S) as on_a, \
                AsyncEncoderClient.grpc(b.grpc_address, timeout=WAIT_S) as on_b:
            return await asyncio.gather(*(c.encode([d], return_embeddings=True) for d in datas for c in (on_a, on_b)))

    answers = asyncio.run(race())
    encodes = sum(r.sample("encoder_images_encoded_total") - n for r, n in zip(replicas, before))
    assert encodes == len(datas)
    for k in range(len(datas)):
        (from_a,), (from_b,) = answers[2 * k], answers[2 * k + 1]
        assert from_a.id == from_b.id and torch.equal(from_a.embedding, from_b.embedding)  # the same rows
    elsewhere = sum(r.sample("encoder_cache_redis_claimed_elsewhere_total") for r in replicas)
    assert 0 < elsewhere <= len(datas)  # the other one waited (or found the rows landed already)
