"""Pins against the real servers (issue 20): a fetch that delivered every row of an id ends its encode's pin,
so a client that encodes and fetches but never releases is not throttled by --max-pinned-bytes.

The service here pins at most 5 tiny images at once (4 KiB of pins, 768 bytes of rows per 64x64 image);
the clients go through many more. Each id's pin ends once its rows were all delivered (several calls add
up; two encodes of one image hold two pins); the rows stay fetchable from the LRU after; a client's release
after its full fetch is counted and ends no other request's pin; pins full answer a 429 that says what to do.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from encoder_service.client import VideoSource
from tests.support.clients import async_client, sync_client
from tests.support.images import image_bytes as png
from tests.support.service import RunningService, make_settings
from tests.support.video_cases import make_clip

pytestmark = pytest.mark.timeout(120)

ROW_BYTES = 48 * 4  # tiny Qwen2.5-VL rows: 48 float32
PINS = ("--cache-bytes", "64KiB", "--max-pinned-bytes", "4KiB")  # 5 pins of a 64x64 image (4 rows, 768 bytes)
IMAGES = 40  # 8x what the pins hold


@pytest.fixture(scope="module")
def pins_service(request, tiny_checkpoint, tmp_path_factory) -> RunningService:
    ckpt = tiny_checkpoint("qwen2_5_vl")
    shm_dir = tmp_path_factory.mktemp("pins-shm")
    svc = RunningService(make_settings(ckpt, *PINS, "--shm-fetch", "--shm-dir", str(shm_dir)), ckpt)
    request.addfinalizer(svc.close)
    return svc


def pin_stats(svc) -> dict:
    async def on_loop():  # the store belongs to the service's loop
        return svc.core.store.local.stats()

    return svc.call(on_loop)


def client(svc, how: str):
    """An async client: "http", "grpc", or "grpc+shm" (rows through a shared-memory file)."""
    transport, _, shm = how.partition("+")
    return async_client(svc, transport, **({"shm": True, "shm_dir": svc.settings.server.shm_dir} if shm else {}))


@pytest.mark.parametrize("how", ["http", "grpc", "grpc+shm"])
async def test_a_client_that_never_releases_is_never_refused(pins_service, how):
    """Four workers encode (with and without waiting) and fetch all rows of 40 distinct images, never
    releasing: no 429, no 404, every row right, no pin left."""
    svc = pins_service
    before = pin_stats(svc)
    seed = {"http": 1000, "grpc": 2000, "grpc+shm": 3000}[how]
    images = iter(range(IMAGES))
    checked = []
    async with client(svc, how) as c:
        async def worker():
            for k in images:  # odd k: the fetch waits for the encode; every 4th: the rows come back to compare
                (info,) = await c.encode([png(64, 64, seed + k)], wait=k % 2 == 0, return_embeddings=k % 4 == 0)
                assert info.num_tokens * ROW_BYTES == 768
                got = await c.fetch([(info.id, 0)], 0, info.num_tokens)
                if info.embedding is not None:
                    assert torch.equal(got.rows, info.embedding)
                    checked.append(k)

        await asyncio.gather(*(worker() for _ in range(4)))
    after = pin_stats(svc)
    assert len(checked) == IMAGES // 4
    assert after["pin_refused"] == before["pin_refused"] and after["lease_expired"] == before["lease_expired"]
    assert after["fetch_ended"] - before["fetch_ended"] == IMAGES
    assert after["pinned_keys"] == 0 and after["pinned_bytes"] == 0


def test_a_chunked_fetch_ends_the_pin_only_after_its_last_rows(pins_service):
    svc = pins_service
    with sync_client(svc, "http") as c:
        (info,) = c.encode([png(112, 84, 4000)], wait=True)  # 4 x 3 merged patches: 12 rows
        assert info.num_tokens == 12
        layout = ([(info.id, 3, info.num_tokens)], 3 + info.num_tokens + 2)  # 3 text tokens, the image, 2 more
        chunks = []
        for chunk in c.iter_chunks(layout, chunk_size=4):  # rows [0,1) [1,5) [5,9) [9,12), then text only
            if chunk.segments:
                chunks.append(chunk)
                done = chunk.segments[-1].row_end == info.num_tokens
                assert svc.pinned(info.id) is not done, [s.row_end for s in chunk.segments]
        assert len(chunks) == 4
        rows = torch.cat([ch.rows for ch in chunks])
        assert torch.equal(c.fetch([(info.id, 0)], 0, 12).rows, rows)  # still cached: the LRU serves it
        assert c.release([info.id]) == 1  # the client's release after its fetch: its (ended) holder
        assert c.release([info.id]) == 0


def test_two_encodes_hold_two_pins_and_one_full_fetch_ends_one(pins_service):
    svc = pins_service
    image = png(56, 56, 4100)
    with sync_client(svc, "grpc") as c:
        (first,) = c.encode([image], wait=True)
        (second,) = c.encode([image])  # a second request for the same image: a second holder
        assert first.id == second.id and second.cached
        c.fetch([(first.id, 0)], 0, first.num_tokens)
        assert svc.pinned(first.id)  # the other request's pin stands
        assert c.release([first.id]) == 1  # the first client's release: its own ended holder ...
        assert svc.pinned(first.id)  # ... not the second request's pin
        # The second request fetches in two calls; the rows stay fetchable once its pin ended too.
        c.fetch([(first.id, 0)], 0, 2)
        assert svc.pinned(first.id)
        c.fetch([(first.id, 0)], 2, first.num_tokens)
        assert not svc.pinned(first.id)
        assert c.fetch([(first.id, 0)], 0, first.num_tokens).rows.shape == (first.num_tokens, 48)


def test_a_video_s_groups_end_their_pins_as_they_are_fetched(pins_service):
    svc = pins_service
    clip = make_clip("mp4_h264", frames=4, width=56, height=56)  # 2 frame groups of 4 rows
    with sync_client(svc, "http") as c:
        (video,) = c.encode_videos([VideoSource(clip, sample_frames=False)], wait=True)
        assert video.num_tokens == 8 and video.tokens_per_group == 4
        groups = [f"{video.id}#{g}" for g in range(2)]
        assert all(svc.pinned(g) for g in groups)
        c.fetch([(groups[0], 0)], 0, 4)
        assert not svc.pinned(groups[0]) and svc.pinned(groups[1])
        c.fetch([(groups[1], 0)], 0, 4)
        assert not svc.pinned(groups[1])
        assert c.release([video.id]) == 1  # a video's release: its groups' ended holders


def test_pins_full_answer_a_429_that_says_what_to_do(pins_service):
    svc = pins_service
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        ids = []
        for k in range(6):  # encodes that are never fetched nor released: the 6th finds the pins full
            r = h.post("/v1/encode", content=png(64, 64, 4200 + k), headers={"content-type": "image/png"})
            if r.status_code != 200:
                break
            ids.append(r.json()["images"][0]["id"])
        assert len(ids) == 5 and r.status_code == 429, r.text
        message = r.json()["error"]["message"]
        assert r.headers["retry-after"]
        for words in ("pins are full", "(5 ids)", "--max-pinned-bytes (4096)", "a fetch has delivered every one of "
                      "its rows", "POST /v1/release", "--lease-s", "raise --max-pinned-bytes (with --cache-bytes)"):
            assert words in message, (words, message)
        r = h.post("/v1/fetch", json={"items": [{"id": ids[0], "offset": 0}], "start": 0, "end": 4})
        assert r.status_code == 200  # fetching all rows of one of them makes room
        r = h.post("/v1/encode", content=png(64, 64, 4206), headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        released = h.post("/v1/release", json={"ids": ids[1:] + [r.json()["images"][0]["id"]]}).json()
        assert released == {"released": 5, "invalid": []}
    assert pin_stats(svc)["pinned_keys"] == 0
