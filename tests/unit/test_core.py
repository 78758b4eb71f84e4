"""EncoderCore on its own, no transports: tiny random models on the CPU, built by the service's own builder
(api/service.py: build_core). What the core does is tested here once; tests/service checks only how HTTP
and gRPC map it (status codes, headers, streaming, auth, body limits, the wire format).

Same image from many requests: encoded once. Many requests at once: each gets its own images' rows. Fetch:
per chunk, exactly the overlapping slices of the whole embeddings (Qwen3's deepstack rows too). Flights
(core/flight.py): a request for an id in flight joins it without queue room, waiters leaving drop the
queued image, a failure is remembered for fetch (and named by its image index when waited for), queue
permits are given back on every path. timeout_s=0 answers what is cached and never waits. Across cores
sharing one Redis (replicas/shared.py): encode marks its misses pending before answering (and goes on when it
cannot), a fetch elsewhere waits for them within its one timeout, and stops waiting at its first error.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import torch

from encoder_service import errors, timeouts
from encoder_service.cache import CacheKey, EmbeddingStore, key_from_id, make_key
from encoder_service.cache.keys import content_tag
from encoder_service.core import FetchItem, ImageInput
from encoder_service.core.flight import Flights
from encoder_service.core.images import Probed
from encoder_service.core.metrics import Metrics
from encoder_service.engine.engine import Engine
from encoder_service.ranges import chunks, plan_chunk
from encoder_service.replicas import Solo
from encoder_service.replicas.directory import binding_name, input_name, is_pending, marker_name
from tests.support.images import image_bytes, truncated_jpeg
from tests.support.reference import assert_close, reference_rows
from tests.support.waits import async_wait_for

pytestmark = pytest.mark.timeout(120)

WAIT_S = 20  # bound on every wait in this file


def with_row_copies(redis_server) -> tuple[str, ...]:
    """Redis flags for cores without HTTP (no replica can fetch from another): the rows go through Redis, as
    copies (--redis-row-copy-bytes); the replica-to-replica path is tested with real servers
    (tests/service/test_replicas.py)."""
    return "--redis-url", redis_server.url, "--redis-row-copy-bytes", "64MiB"


def inputs(*datas: bytes) -> list[ImageInput]:
    return [ImageInput(data=d) for d in datas]


def key_of(core, data: bytes) -> CacheKey:
    return make_key(data, core.model_fp, core.settings.cache.hash)


def images_encoded(core) -> float:
    """Images through the ViT so far for requests (the start-up warm-up is not counted)."""
    return core.metrics.registry.get_sample_value("encoder_images_encoded_total") or 0.0


def cache_misses(core) -> float:
    """Flights that found the rows in no tier and encoded them."""
    return core.metrics.registry.get_sample_value("encoder_cache_misses_total") or 0.0


async def fetch_all(core, info) -> torch.Tensor:
    return (await core.fetch([FetchItem(info.id, 0)], 0, info.num_tokens, timeout_s=WAIT_S)).rows


# ---- encode and fetch ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
async def test_fetch_equals_slices_of_the_whole_embedding(make_core, tiny_checkpoint, family):
    core = await make_core(family)
    imgs = [image_bytes(w, h, 10 + i) for i, (w, h) in enumerate([(90, 60), (64, 64), (200, 40), (70, 130)])]
    result = await core.encode(inputs(*imgs), return_embeddings=True)
    infos, whole = result.images, result.embeddings
    width = infos[0].row_width
    assert all(w.shape == (i.num_tokens, width) for i, w in zip(infos, whole))
    if family == "qwen3_vl":
        assert infos[0].layout == "main+deepstack3" and width == 4 * infos[0].hidden_size
    for rows, data in zip(whole, imgs):
        assert_close(rows, reference_rows(tiny_checkpoint(family), data))
    # Prompt: text(5), img0, img1 adjacent, text(3), img2, text(3), img3, text(2).
    items, pos = [], 5
    for k, info in enumerate(infos):
        items.append((info.id, pos, info.num_tokens))
        pos += info.num_tokens + (0 if k == 0 else 3)
    prompt_len = pos - 1
    expected = torch.zeros(prompt_len, width)
    for (_, offset, n), rows in zip(items, whole):
        expected[offset:offset + n] = rows
    full = dict(zip((i.id for i in infos), whole))
    # 1: every chunk splits images; 7: straddles; 50: several images per chunk; prompt_len: one chunk
    for chunk_size in (1, 3, 7, 16, 50, prompt_len):
        got = torch.zeros(prompt_len, width)
        for start, end in chunks(prompt_len, chunk_size):
            overlapping = [it for it in items if it[1] < end and start < it[1] + it[2]]
            answers = [await core.fetch([FetchItem(i, o) for i, o, _ in asked], start, end)
                       for asked in (items, overlapping) if asked]
            for r in answers:  # every item asked, or only those overlapping: the same answer
                assert r.segments == plan_chunk(items, start, end)
                assert all(start <= s.position and s.position + s.num_rows <= end for s in r.segments)
                assert (r.dtype, r.row_width, r.layout) == (infos[0].dtype, width, infos[0].layout)
                packed = [full[s.id][s.row_start:s.row_end] for s in r.segments]
                assert torch.equal(r.rows, torch.cat(packed) if packed else torch.empty(0, width))
            at = 0
            for s in answers[0].segments:
                got[s.position:s.position + s.num_rows] = answers[0].rows[at:at + s.num_rows]
                at += s.num_rows
        assert torch.equal(got, expected), f"chunk size {chunk_size}"


async def test_the_warm_up_encode_is_not_counted(make_core):
    core = await make_core()  # started: the warm-up encode ran through the engine
    sample = core.metrics.registry.get_sample_value
    assert core.ready() and images_encoded(core) == 0
    assert sample("encoder_encode_seconds_count") == sample("encoder_preprocess_seconds_count") == 0
    await core.encode(inputs(image_bytes(64, 64, 4241)), wait=True)
    assert images_encoded(core) == 1 and sample("encoder_encode_seconds_count") == 1


async def test_every_cpu_thread_warms_on_a_1080p_photo_unless_the_limits_refuse_one(make_core, caplog):
    """The start-up warm-up of each CPU thread (run on CUDA; called here on the CPU): a 1080p photo prepared on
    every thread, nothing encoded; under limits that refuse such a photo the start goes on without it."""
    import logging

    caplog.set_level(logging.INFO, logger="encoder_service.core.encoder")
    core = await make_core()
    await core._warm_every_cpu_thread()
    assert "each CPU thread prepared a 1080p photo" in caplog.text and images_encoded(core) == 0
    small = await make_core("qwen2_5_vl", "--max-pixels", "1000000")
    await small._warm_every_cpu_thread()
    assert "not warmed with a 1080p photo" in caplog.text and small.ready()


async def test_the_cpu_threads_warm_up_ends_at_once_when_the_engine_stops(make_core):
    from encoder_service.engine.engine import Job

    core = await make_core()
    gate = threading.Event()

    class Stuck:
        @staticmethod
        def prepare(data, grid_thw):
            assert gate.wait(WAIT_S)  # until the test lets it go

    warming = asyncio.create_task(core.engine.warm_preparers(Job(b"", (1, 2, 2), Stuck), timeout_s=60))
    await asyncio.sleep(0.2)
    stopping = asyncio.create_task(core.engine.stop())
    with pytest.raises(errors.Unavailable):
        await asyncio.wait_for(warming, 5)
    gate.set()
    await asyncio.wait_for(stopping, 30)


async def test_same_image_from_many_requests_is_encoded_once(make_core):
    core = await make_core()
    data = image_bytes(96, 96, 4242)
    encoded, misses = images_encoded(core), cache_misses(core)
    results = await asyncio.wait_for(asyncio.gather(*(core.encode(inputs(data), wait=True) for _ in range(16))),
                                     WAIT_S)
    infos = [r.images[0] for r in results]
    assert len({i.id for i in infos}) == 1
    assert sum(not i.cached for i in infos) == 1  # the request whose miss ran the encode; the rest joined it
    assert images_encoded(core) - encoded == 1 and cache_misses(core) - misses == 1
    (again,) = (await core.encode(inputs(data))).images
    assert again.cached
    rows = await asyncio.gather(*(fetch_all(core, again) for _ in range(4)))
    assert all(torch.equal(r, rows[0]) for r in rows)
    assert images_encoded(core) - encoded == 1 and core.engine.permits == 0


async def test_concurrent_requests(make_core, tiny_checkpoint):
    core = await make_core()
    imgs = [image_bytes(40 + 8 * k, 70, 100 + k) for k in range(12)]
    encoded = images_encoded(core)

    async def one(k: int):
        result = await core.encode(inputs(imgs[k], imgs[(k + 1) % len(imgs)]), return_embeddings=True)
        a, b = result.images
        items = [FetchItem(a.id, 0), FetchItem(b.id, a.num_tokens)]
        rows = [(await core.fetch(items, s, e)).rows for s, e in chunks(a.num_tokens + b.num_tokens, 5)]
        assert torch.equal(torch.cat(rows), torch.cat(result.embeddings))
        return result

    results = await asyncio.wait_for(asyncio.gather(*(one(k) for k in range(len(imgs)))), WAIT_S)
    assert len({r.images[0].id for r in results}) == len(imgs)
    for k in (0, 5):
        assert_close(results[k].embeddings[0], reference_rows(tiny_checkpoint("qwen2_5_vl"), imgs[k]))
    assert images_encoded(core) - encoded == len(imgs)  # each once, though two requests asked for each


# ---- flights ---------------------------------------------------------------------------------------------
async def hold_the_gpu(core) -> None:
    """The GPU thread holds one image and a batch of one more waits for it: what is submitted next queues."""
    core.runner.gate.clear()
    await core.encode(inputs(image_bytes(56, 56, 1)))
    assert await asyncio.to_thread(core.runner.entered.acquire, True, WAIT_S)
    await core.encode(inputs(image_bytes(56, 56, 2)))
    await async_wait_for(lambda: core.engine.queue_depth == 0 and core.engine.permits == 0, "the waiting batch", WAIT_S)


async def test_a_request_for_an_id_in_flight_joins_it(make_core):
    core = await make_core("qwen2_5_vl", "--max-queue", "1", gated=True)
    await hold_the_gpu(core)
    encoded = images_encoded(core)
    data = image_bytes(84, 84, 3)
    name = key_of(core, data).name
    (first,) = (await core.encode(inputs(data))).images
    await async_wait_for(lambda: core.engine.queue_depth == 1, "the image to queue", WAIT_S)  # the queue is full now
    with pytest.raises(errors.Overloaded, match="encode queue is full"):
        await core.encode(inputs(image_bytes(84, 84, 4)))
    joined = asyncio.create_task(core.encode(inputs(data), wait=True))  # needs no queue room: joins
    await async_wait_for(lambda: core.flights.get(name).waiters == 2, "the second request to join the flight", WAIT_S)
    assert core.engine.permits == 0 and core.engine.queue_depth == 1
    core.runner.gate.set()
    (second,) = (await asyncio.wait_for(joined, WAIT_S)).images
    assert second.id == first.id and not first.cached and second.cached  # the first one's miss ran the encode
    assert images_encoded(core) - encoded == 3  # the two holding the GPU, and this one once


async def test_waiters_leaving_drop_the_queued_image(make_core):
    core = await make_core("qwen2_5_vl", gated=True)
    await hold_the_gpu(core)
    encoded = images_encoded(core)
    gone, kept = image_bytes(70, 70, 5), image_bytes(98, 70, 6)
    gone_key, kept_key = key_of(core, gone), key_of(core, kept)
    requests = [asyncio.create_task(core.encode(inputs(data), wait=True)) for data in (gone, kept)]
    await async_wait_for(lambda: core.engine.queue_depth == 2, "both images to queue", WAIT_S)
    kept_flight = core.flights.get(kept_key.name)
    reading = asyncio.create_task(core.fetch([FetchItem(kept_key.id, 0)], 0, kept_flight.num_tokens,
                                             timeout_s=WAIT_S))
    await async_wait_for(lambda: kept_flight.waiters == 2, "the fetch to wait for the kept image", WAIT_S)
    for task in requests:  # both callers leave; a fetch still waits for the kept image
        task.cancel()
    await asyncio.gather(*requests, return_exceptions=True)
    # Nobody wants the dropped image: its flight ends and its queue slot returns at once (issue 22 item 3),
    # not when the next batch is built.
    assert gone_key.name not in core.flights and kept_flight.waiters == 1
    await async_wait_for(lambda: core.engine.queue_depth == 1, "the dropped image to leave the queue", WAIT_S)
    core.runner.gate.set()
    rows = (await asyncio.wait_for(reading, WAIT_S)).rows
    assert rows.shape == (kept_flight.num_tokens, 48)
    assert images_encoded(core) - encoded == 3  # the two holding the GPU, and the kept one: not the dropped one
    with pytest.raises(errors.NotFound, match="unknown id"):
        await core.fetch([FetchItem(gone_key.id, 0)], 0, 4)
    assert not core.store.local.is_pinned(gone_key.name) and not core.store.local.is_pinned(kept_key.name)


# ---- an id names one content -----------------------------------------------------------------------------
def named(data: bytes, caller_id: str) -> list[ImageInput]:
    return [ImageInput(data=data, caller_id=caller_id)]


async def test_a_caller_id_never_names_two_contents(make_core):
    core = await make_core("qwen2_5_vl", gated=True)
    a, b = image_bytes(64, 64, 50), image_bytes(96, 64, 51)  # 4 and 6 tokens
    first = await core.encode(named(a, "shared"), return_embeddings=True)
    with pytest.raises(errors.Conflict, match="^image 0: id 'u:shared' already names other image bytes"):
        await core.encode(named(b, "shared"), wait=True)
    (again,) = (await core.encode(named(a, "shared"), wait=True)).images  # the same bytes: the same id
    assert again.cached and again.grid_thw == first.images[0].grid_thw
    assert torch.equal(await fetch_all(core, again), first.embeddings[0])  # still a's rows
    with pytest.raises(errors.Conflict, match="^image 1: id 'u:pair'"):  # two images of one request
        await core.encode([ImageInput(data=a, caller_id="pair"), ImageInput(data=b, caller_id="pair")])
    await hold_the_gpu(core)
    await core.encode(named(a, "flying"))  # encoding now: its flight knows the bytes
    with pytest.raises(errors.Conflict, match="'u:flying'"):
        await core.encode(named(b, "flying"))
    assert core.engine.permits == 0 and not core.store.local.is_pinned(key_of(core, b).name)
    core.runner.gate.set()
    (flown,) = (await asyncio.wait_for(core.encode(named(a, "flying"), wait=True), WAIT_S)).images
    assert flown.num_tokens == 4


async def test_a_caller_id_names_one_content_across_replicas(make_core, redis_server, monkeypatch):
    a_core = await make_core("qwen2_5_vl", *with_row_copies(redis_server), gated=True)
    b_core = await make_core("qwen2_5_vl", *with_row_copies(redis_server))
    a, b = image_bytes(64, 64, 52), image_bytes(96, 64, 53)
    # Rows another replica wrote (in Redis): a Conflict before the answer, without waiting.
    await a_core.encode(named(a, "x"), wait=True)
    await a_core.replicas.redis.flush()
    with pytest.raises(errors.Conflict, match="'u:x' already names other image bytes"):
        await b_core.encode(named(b, "x"))
    (same,) = (await b_core.encode(named(a, "x"), wait=True)).images
    assert same.cached and b_core.metrics.registry.get_sample_value("encoder_cache_hits_total", {"tier": "redis"}) == 1
    # Another replica's encode still running: its pending marker carries the bytes' tag.
    a_core.runner.gate.clear()
    await a_core.encode(named(a, "y"))
    with pytest.raises(errors.Conflict, match="'u:y'"):
        await b_core.encode(named(b, "y"))
    a_core.runner.gate.set()
    # Where Redis could not tell before the answer (the binding not checked: Redis was away for it), the rows
    # the fill finds can: a waiting encode fails with the Conflict, but that is the request's failure, never the
    # id's: a fetch of the id there gets the rows of the content it names.
    (first,) = (await a_core.encode(named(a, "z"), wait=True, return_embeddings=True)).embeddings
    await a_core.replicas.redis.flush()

    async def cannot_tell(tags):
        return {}

    monkeypatch.setattr(b_core.replicas, "bind_tags", cannot_tell)
    with pytest.raises(errors.Conflict, match="'u:z' already names other"):
        await b_core.encode(named(b, "z"), wait=True, timeout_s=WAIT_S)
    rows = await b_core.fetch([FetchItem("u:z", 0)], 0, first.shape[0], timeout_s=WAIT_S)
    assert torch.equal(rows.rows, first)
    # The conflicting request's claim and kept bytes are gone (before: B renewed a pending marker for the lease,
    # and another replica encoding the id waited on it: 504), and the binding names the rows that exist.
    name = key_from_id("u:z", b_core.model_fp, b_core.settings.cache.hash).name
    with redis.Redis.from_url(redis_server.url) as direct:
        assert direct.exists(marker_name(name), input_name(name)) == 0
        assert direct.get(binding_name(name)) == b"%016x" % content_tag(a)


# ---- timeout_s -------------------------------------------------------------------------------------------
async def test_a_cancelled_waiter_does_not_cancel_the_encode_others_wait_for(make_core):
    core = await make_core("qwen2_5_vl", gated=True)
    await hold_the_gpu(core)
    encoded = images_encoded(core)
    data = image_bytes(76, 76, 16)
    first = asyncio.create_task(core.encode(inputs(data), wait=True))
    await async_wait_for(lambda: key_of(core, data).name in core.flights, "the first request's flight", WAIT_S)
    flight = core.flights.get(key_of(core, data).name)
    second = asyncio.create_task(core.encode(inputs(data), wait=True))
    await async_wait_for(lambda: flight.waiters == 2, "the second request to join", WAIT_S)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert first.cancelled() and flight.waiters == 1
    core.runner.gate.set()
    result = await asyncio.wait_for(core.encode(inputs(data), wait=True, return_embeddings=True), WAIT_S)
    (info,) = (await asyncio.wait_for(second, WAIT_S)).images
    assert info.cached and images_encoded(core) - encoded == 3  # the two holding the GPU, and this one once
    assert torch.equal(await fetch_all(core, info), result.embeddings[0])


async def test_a_failure_reaches_every_waiter_and_nothing_is_cached(make_core):
    core = await make_core()
    truncated = truncated_jpeg(9)
    requests = [core.encode(inputs(image_bytes(56, 56, 30 + k), truncated), wait=True) for k in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), WAIT_S)
    assert all(isinstance(r, errors.ImageDecodeError) and r.message.startswith("image 1: ") for r in results)
    assert core.store.peek(key_of(core, truncated)) is None and core.engine.permits == 0


async def test_timeout_zero_answers_with_cached_rows_and_never_waits(make_core):
    core = await make_core("qwen2_5_vl", gated=True)
    cached = image_bytes(64, 64, 20)
    (info,) = (await core.encode(inputs(cached), wait=True)).images
    n = info.num_tokens
    result = await core.encode(inputs(cached), wait=True, return_embeddings=True, timeout_s=0)
    assert result.images[0].cached and result.embeddings[0].shape == (n, 48)
    assert (await core.fetch([FetchItem(info.id, 0)], 0, n, timeout_s=0)).rows.shape == (n, 48)

    await hold_the_gpu(core)  # what is submitted now stays encoding until the gate opens
    fresh = image_bytes(70, 70, 21)
    with pytest.raises(errors.DeadlineExceeded, match="timeout_s=0.*1 of the request's images are not cached"):
        await asyncio.wait_for(core.encode(inputs(cached, fresh), wait=True, timeout_s=0), WAIT_S)
    items = [FetchItem(info.id, 0), FetchItem(key_of(core, fresh).id, n)]
    with pytest.raises(errors.DeadlineExceeded, match="timeout_s=0.*still encoding"):
        await asyncio.wait_for(core.fetch(items, 0, 10_000, timeout_s=0), WAIT_S)
    assert (await core.fetch(items, 0, n, timeout_s=0)).rows.shape == (n, 48)  # only the cached image's rows
    core.runner.gate.set()
    assert (await core.fetch(items, 0, 10_000, timeout_s=WAIT_S)).segments[1].row_start == 0  # the encode went on

    for bad in (-1, -1e-9, float("nan"), float("inf"), True, "5"):
        with pytest.raises(errors.InvalidInput, match="timeout_s must be a finite number of seconds >= 0"):
            await core.encode(inputs(cached), wait=True, timeout_s=bad)
        with pytest.raises(errors.InvalidInput, match="timeout_s must be"):
            await core.fetch([FetchItem(info.id, 0)], 0, n, timeout_s=bad)


async def test_a_decode_failure_names_the_image_when_waited_for(make_core):
    core = await make_core()
    with pytest.raises(errors.ImageDecodeError, match=r"^image 2: .*trunc"):
        await core.encode(inputs(image_bytes(56, 56, 23), image_bytes(56, 84, 24), truncated_jpeg(22)), wait=True)


async def test_a_failed_encode_is_remembered_for_fetch(make_core):
    core = await make_core()
    truncated = truncated_jpeg(5)
    (info,) = (await core.encode(inputs(truncated))).images
    await async_wait_for(lambda: key_of(core, truncated).name not in core.flights, "the encode to fail", WAIT_S)
    for _ in range(2):  # remembered, not a 404
        with pytest.raises(errors.ImageDecodeError, match=f"encode of id '{info.id}' failed: .*trunc"):
            await core.fetch([FetchItem(info.id, 0)], 0, 4)
    with pytest.raises(errors.ImageDecodeError, match="trunc"):  # a new encode forgets it, and tries again
        await core.encode(inputs(truncated), wait=True)
    assert core.engine.permits == 0


async def test_a_fetch_sized_by_a_flight_that_fails_before_its_rows_are_read_gets_the_failure(make_core):
    # The race behind a flaky 404: the chunk is sized from the id's flight, the flight fails (and ends)
    # before the rows are read, and the store has nothing: the remembered failure answers, not "unknown id".
    core = await make_core()
    truncated = truncated_jpeg(7)
    (info,) = (await core.encode(inputs(truncated))).images
    flight = core.flights.get(key_of(core, truncated).name)
    num_tokens = core.id_rows.num_tokens

    async def sized_then_failed(key, deadline, peer):
        n = await num_tokens(key, deadline, peer)
        await asyncio.gather(flight.task, return_exceptions=True)
        return n

    core.id_rows.num_tokens = sized_then_failed
    with pytest.raises(errors.ImageDecodeError, match=f"encode of id '{info.id}' failed: .*trunc"):
        await core.fetch([FetchItem(info.id, 0)], 0, 4, timeout_s=WAIT_S)


class Undecodable:
    """An engine reader whose every image fails to decode: the image's own fault."""

    def prepare(self, data, grid_thw):
        raise errors.ImageDecodeError("cannot identify image file")


async def test_failures_are_remembered_up_to_a_bound():
    engine = Engine(encode=lambda pixel_values, grids: [], batch_tokens=64)
    await engine.start()
    try:
        flights = Flights(Solo(EmbeddingStore(1 << 20)), engine, Metrics(), layout="main", lease_s=60, failures_kept=2)
        keys = [make_key(bytes([k]), "fp") for k in range(3)]
        for key in keys:
            flight = flights.join(Probed(key, (1, 2, 2), 1, b"image", reader=Undecodable()), None)
            with pytest.raises(errors.ImageDecodeError):
                await flight.task
            assert key.name not in flights
    finally:
        await engine.stop()
    flights.raise_failure(keys[0])  # the oldest is forgotten
    for key in keys[1:]:
        with pytest.raises(errors.ImageDecodeError, match=f"encode of id '{key.id}' failed: .*cannot identify"):
            flights.raise_failure(key)


class Blank:
    def prepare(self, data, grid_thw):
        return torch.zeros(4, 8)


@pytest.mark.parametrize("failure", ["timeout", "unavailable"])
async def test_a_failure_not_of_the_image_is_not_its_outcome(failure):
    """Issue 38: a timeout (here: the lease over before the image left the queue), or this replica's engine
    unavailable (never started), was remembered as the id's outcome and answered to every later fetch of it
    (504 until it was encoded again)."""
    engine = Engine(encode=lambda pixel_values, grids: [], batch_tokens=64)
    if failure == "timeout":
        await engine.start()
    try:
        flights = Flights(Solo(EmbeddingStore(1 << 20)), engine, Metrics(), layout="main",
                          lease_s=0.0 if failure == "timeout" else 60)
        key = make_key(b"x", "fp")
        flight = flights.join(Probed(key, (1, 2, 2), 1, b"image", reader=Blank()), None)
        with pytest.raises(errors.DeadlineExceeded if failure == "timeout" else errors.Unavailable):
            await flight.task
    finally:
        await engine.stop()
    flights.raise_failure(key)  # nothing remembered


async def test_queue_permits_are_given_back(make_core, redis_server):
    # A miss the queue has no room for: 429, nothing admitted or pinned stays.
    core = await make_core("qwen2_5_vl", "--max-queue", "1")
    with pytest.raises(errors.Overloaded, match="max_queue is 1"):
        await core.encode(inputs(image_bytes(56, 56, 10), image_bytes(56, 56, 11)))
    assert core.engine.permits == 0 and core.store.stats()["local_pinned_keys"] == 0
    # Admitted, then the pins are full: 429, the permits go back.
    core = await make_core("qwen2_5_vl", "--max-pinned-bytes", "1KiB")
    await core.encode(inputs(image_bytes(64, 64, 12)))  # 4 tokens x 48 x 4 bytes = 768 B: fits
    with pytest.raises(errors.Overloaded, match="max-pinned-bytes"):  # 768 B more would fit alone: 429
        await core.encode(inputs(image_bytes(64, 64, 13)))
    assert core.engine.permits == 0
    # A miss here that Redis has (another replica encoded it): never submitted, the permit goes back.
    writer = await make_core("qwen2_5_vl", *with_row_copies(redis_server))
    reader = await make_core("qwen2_5_vl", *with_row_copies(redis_server))
    data = image_bytes(80, 60, 14)
    (first,) = (await writer.encode(inputs(data), wait=True)).images
    await writer.replicas.redis.flush()  # the write-behind has landed
    encoded = images_encoded(reader)
    (second,) = (await reader.encode(inputs(data), wait=True)).images
    assert second.id == first.id and second.cached and images_encoded(reader) == encoded
    assert reader.engine.permits == 0
    assert reader.metrics.registry.get_sample_value("encoder_cache_hits_total", {"tier": "redis"}) == 1


# ---- across replicas (replicas/shared.py; the two real replicas: tests/service/test_replicas.py) ------------
def marker_of(redis_server, key: CacheKey) -> bytes | None:
    with redis.Redis.from_url(redis_server.url) as direct:
        return direct.get(marker_name(key.name))


async def test_encode_marks_its_misses_pending_before_answering(make_core, redis_server):
    core = await make_core("qwen2_5_vl", *with_row_copies(redis_server), gated=True)
    core.runner.gate.clear()  # the ViT holds the image: the encode is still running when it answers
    data = image_bytes(64, 64, 40)
    await core.encode(inputs(data))
    assert is_pending(marker_of(redis_server, key_of(core, data)))
    core.runner.gate.set()
    await core.encode(inputs(data), wait=True)
    await core.replicas.redis.flush()
    assert marker_of(redis_server, key_of(core, data)) is None  # the rows landed: the marker went with them
    marked = core.replicas.stats()["redis_pending_marked"]
    await core.encode(inputs(data))  # cached here: nothing to mark
    assert core.replicas.stats()["redis_pending_marked"] == marked


async def test_encode_goes_on_when_its_marker_cannot_be_written(make_core, redis_server):
    core = await make_core("qwen2_5_vl", *with_row_copies(redis_server))
    redis_server.kill()
    (info,) = (await core.encode(inputs(image_bytes(64, 64, 41)), wait=True)).images
    assert info.num_tokens == 4 and not info.cached
    assert core.metrics.registry.get_sample_value("encoder_pending_unmarked_total") == 1


async def test_a_fetch_on_another_core_waits_within_its_one_timeout(make_core, redis_server):
    a = await make_core("qwen2_5_vl", *with_row_copies(redis_server), gated=True)
    b = await make_core("qwen2_5_vl", *with_row_copies(redis_server))
    a.runner.gate.clear()
    data = image_bytes(64, 64, 42)
    (info,) = (await a.encode(inputs(data))).images
    t0 = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded, match="timeout_s=0 .* still encoding on another replica"):
        await b.fetch([FetchItem(info.id, 0)], 0, 4, timeout_s=0)
    with pytest.raises(errors.DeadlineExceeded, match="within timeout_s=0.2"):
        await b.fetch([FetchItem(info.id, 0)], 0, 4, timeout_s=0.2)
    assert time.monotonic() - t0 < 10  # the timeouts ended them (else they'd wait for the gate: the test's timeout)
    fetching = asyncio.create_task(b.fetch([FetchItem(info.id, 0)], 0, 4, timeout_s=WAIT_S))
    await async_wait_for(lambda: b.replicas.stats()["redis_pending_waits"] == 2, "B's fetch waiting", WAIT_S)
    a.runner.gate.set()
    rows = (await asyncio.wait_for(fetching, WAIT_S)).rows
    assert torch.equal(rows, (await a.fetch([FetchItem(info.id, 0)], 0, 4)).rows)


async def test_a_fetch_stops_waiting_elsewhere_when_another_of_its_ids_is_unknown(make_core, redis_server):
    b = await make_core("qwen2_5_vl", *with_row_copies(redis_server))
    pending = key_from_id("ab" * 16, b.model_fp, b.settings.cache.hash)
    assert await b.replicas.mark_pending([pending])  # as another replica that accepted it (and never finishes)
    fetching = asyncio.create_task(b.fetch([FetchItem(pending.id, 0), FetchItem("cd" * 16, 8)], 0, 12,
                                           timeout_s=WAIT_S))
    with pytest.raises(errors.NotFound, match="'cd"):
        await asyncio.wait_for(fetching, 5)
    await async_wait_for(lambda: b.replicas.stats()["redis_pending_channels"] == 0,
                         "the wait for the other id cancelled", WAIT_S)
    redis_server.kill()
    with pytest.raises(errors.Unavailable, match="Redis tier"):  # not here, and Redis cannot tell: 503
        await b.fetch([FetchItem("ef" * 16, 0)], 0, 4, timeout_s=WAIT_S)


def test_deadline_gives_each_wait_what_is_left():
    now = [100.0]
    deadline = timeouts.Deadline(2.0, clock=lambda: now[0])
    assert deadline.left() == deadline.bound() == 2.0 and not deadline.dont_wait
    now[0] = 101.5
    assert deadline.left() == deadline.bound() == 0.5
    now[0] = 103.0
    assert deadline.left() == 0.0  # past: the next wait answers with the state now
    assert timeouts.Deadline(None).left() is None and timeouts.Deadline(None).bound() is None
    dont_wait = timeouts.Deadline(0.0)
    assert dont_wait.dont_wait and dont_wait.left() == 0.0 and dont_wait.bound() is None


async def test_a_fetch_of_an_id_whose_flight_waits_for_its_marker_waits_for_the_flight(make_core, redis_server):
    """A new flight's fill starts once the id's pending marker is written (a Redis round trip): a fetch of the
    id meanwhile (another request's: its encode joined the flight) waits for the flight, it is no 404."""
    core = await make_core("qwen2_5_vl", *with_row_copies(redis_server))
    gate, mark_pending = asyncio.Event(), core.replicas.mark_pending

    async def slow_mark_pending(keys, **kw):
        await gate.wait()
        return await mark_pending(keys, **kw)

    core.replicas.mark_pending = slow_mark_pending
    data = image_bytes(64, 64, 43)
    key = key_of(core, data)
    encoding = asyncio.create_task(core.encode(inputs(data)))
    await async_wait_for(lambda: key.name in core.flights, "the flight", WAIT_S)
    fetching = asyncio.create_task(core.fetch([FetchItem(key.id, 0)], 0, 4, timeout_s=WAIT_S))
    await async_wait_for(lambda: fetching.done() or core.flights.get(key.name).waiters == 2, "the fetch's wait",
                         WAIT_S)
    assert not fetching.done()  # waiting for the flight, not answered 404
    gate.set()
    await encoding
    rows = (await asyncio.wait_for(fetching, WAIT_S)).rows
    assert torch.equal(rows, (await core.fetch([FetchItem(key.id, 0)], 0, 4)).rows)
