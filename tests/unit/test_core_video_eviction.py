"""A video in flight that a second request needs with a group the flight will not encode: the group was cached
when the flight started and evicted since (its pin ended once it was fetched in full). The second request waits
that flight out and encodes the group itself; its rows are the video's, and the group can be fetched again.
(Before: `return_embeddings` failed with an internal error, and a fetch of the group was 404 for good.)
"""

from __future__ import annotations

import asyncio

import pytest

from encoder_service.core import FetchItem
from encoder_service.core.types import VideoInput
from tests.support.reference import assert_close, reference_video_rows
from tests.support.video_cases import make_clip

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30
CLIP = make_clip("mp4_h264", frames=8, width=96, height=64)  # 4 frame groups
VIDEO = VideoInput(data=CLIP, sample_frames=False)


def evict(core, item_id: str) -> None:
    """The LRU's own eviction step for one unpinned entry (a real eviction needs the cache full at that moment)."""
    name = core.key_of(item_id).name
    assert not core.store.local.is_pinned(name)
    core.store.local._drop(name)


async def test_a_group_evicted_while_its_video_is_in_flight(make_core):
    core = await make_core("qwen2_5_vl", gated=True)
    (info,) = (await core.encode([], videos=[VIDEO], wait=True)).videos
    core.release([info.id])
    for g in (1, 2, 3):
        evict(core, info.group_id(g))
    core.runner.gate.clear()
    await core.encode([], videos=[VIDEO])  # A: a flight for groups 1-3, held at the GPU
    whole = (await core.fetch([FetchItem(info.group_id(0), 0)], 0, info.tokens_per_group)).rows
    evict(core, info.group_id(0))  # A fetched group 0 in full: unpinned, then evicted
    b = asyncio.create_task(core.encode([], videos=[VIDEO], return_embeddings=True))
    await asyncio.sleep(0.2)  # B has looked its groups up (it is waiting for A's flight, nothing to observe)
    core.runner.gate.set()
    (rows,) = (await asyncio.wait_for(b, WAIT_S)).embeddings
    want = reference_video_rows(core.settings.model.model, CLIP, {"sample_frames": False})
    assert_close(rows, want)
    again = (await core.fetch([FetchItem(info.group_id(0), 0)], 0, info.tokens_per_group, timeout_s=WAIT_S)).rows
    assert_close(again, whole)
