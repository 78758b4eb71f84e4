"""Videos in the core (core/videos.py, video_flights.py, video_encode.py), no transports: a video's frame groups
go to the engine in order, at most --video-window at a time, decoded in order from one decoder; a fetch of a
group not reached yet waits for it and makes the groups submitted meanwhile urgent; the same video from two
requests is encoded once; a request that leaves drops its video; admission and pins are all or none. Also
the pieces: the decoder shared by the CPU threads, video keys and ids, VideoInfo, the video settings.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from encoder_service import errors, settings
from encoder_service.cache.video_keys import GROUP_SEP, group_key, video_caller_key, video_key, video_key_from_id
from encoder_service.core import FetchItem
from encoder_service.core import videos as videos_module
from encoder_service.core.types import VideoInput
from encoder_service.preprocessing import VideoConfig, VideoLimits, VideoOptions, plan_video, probe_video
from encoder_service.protocol import video_info
from tests.support.reference import assert_close, reference_video_rows
from tests.support.video_cases import make_clip
from tests.support.waits import async_wait_for

pytestmark = pytest.mark.timeout(120)

WAIT_S = 20
CLIP = make_clip("mp4_h264", frames=12, width=96, height=64)  # 6 frame groups
EVERY_FRAME = VideoInput(data=CLIP, sample_frames=False)


def groups_encoded(core) -> float:
    return core.metrics.registry.get_sample_value("encoder_images_encoded_total") or 0.0


class Decodes:
    """Counts the decoders opened and the groups they yielded (iter_frame_groups, wrapped)."""

    def __init__(self, monkeypatch):
        self.opened, self.yielded = 0, 0
        real = videos_module.iter_frame_groups

        def counted(*args):
            self.opened += 1
            for group in real(*args):
                self.yielded += 1
                yield group

        monkeypatch.setattr(videos_module, "iter_frame_groups", counted)


async def test_groups_go_in_order_a_window_at_a_time(make_core, monkeypatch):
    decodes = Decodes(monkeypatch)
    core = await make_core("qwen2_5_vl", "--video-window", "2", gated=True)
    core.runner.gate.clear()
    (info,) = (await core.encode([], videos=[EVERY_FRAME])).videos
    assert info.num_groups == 6
    assert await asyncio.to_thread(core.runner.entered.acquire, True, WAIT_S)  # a batch holds the GPU
    vf = core.videos.video_flights.get(core.key_of(info.group_id(0)).name.rpartition(GROUP_SEP)[0])
    await async_wait_for(lambda: len(vf.flights) == 2, "the window's groups", WAIT_S)
    # The driver runs on this loop: the wait above saw it join its second group and park (or go on). The
    # decoder runs on the engine's CPU threads, with no event for "did not read on": 0.2 s lets one that read
    # past the window show it (a group of this clip decodes in milliseconds). A slower machine can only hide
    # an overrun here, never fail a correct driver.
    await asyncio.sleep(0.2)
    assert sorted(vf.flights) == [0, 1] and decodes.yielded <= 2
    core.runner.gate.set()
    rows = (await core.fetch([FetchItem(i, o) for i, o, _ in info.fetch_items(offset=0)], 0, info.num_tokens,
                             timeout_s=WAIT_S)).rows
    assert_close(rows, reference_video_rows(core.settings.model.model, CLIP, {"sample_frames": False}))
    assert decodes.opened == 1 and decodes.yielded == 6  # one decoder, each group decoded once, in order


async def test_a_fetch_waits_for_a_group_not_reached_and_hurries_it(make_core):
    core = await make_core("qwen2_5_vl", "--video-window", "1", gated=True)
    core.runner.gate.clear()
    (info,) = (await core.encode([], videos=[EVERY_FRAME])).videos
    assert await asyncio.to_thread(core.runner.entered.acquire, True, WAIT_S)  # group 0 on the GPU
    vf = core.videos.video_flights.get(core.key_of(info.group_id(0)).name.rpartition(GROUP_SEP)[0])
    items = [FetchItem(i, o) for i, o, _ in info.fetch_items(offset=0)]
    third = items[3].offset
    fetch = asyncio.create_task(core.fetch(items, third, third + info.tokens_per_group, timeout_s=WAIT_S))
    await async_wait_for(lambda: vf.demand == 3, "the fetch's demand", WAIT_S)
    assert 3 not in vf.flights
    core.runner.gate.set()
    result = await asyncio.wait_for(fetch, WAIT_S)
    assert [s.id for s in result.segments] == [info.group_id(3)]
    assert [vf.flights[g].urgent for g in range(4)] == [False, True, True, True]
    await asyncio.wait_for(asyncio.shield(vf.task), WAIT_S)
    assert not vf.flights[4].urgent  # past what a fetch asked for: in turn


async def test_the_same_video_from_two_requests_is_encoded_once(make_core):
    core = await make_core("qwen3_vl")
    before = groups_encoded(core)
    first, second = await asyncio.gather(core.encode([], videos=[EVERY_FRAME], wait=True),
                                         core.encode([], videos=[EVERY_FRAME], return_embeddings=True))
    assert first.videos[0].id == second.videos[0].id
    assert sorted([first.videos[0].cached, second.videos[0].cached]) == [False, True]  # one of them ran it
    assert groups_encoded(core) - before == 6
    again = await core.encode([], videos=[EVERY_FRAME], return_embeddings=True)
    assert again.videos[0].cached and groups_encoded(core) - before == 6
    assert torch.equal(again.embeddings[0], second.embeddings[0])
    assert_close(again.embeddings[0], reference_video_rows(core.settings.model.model, CLIP, {"sample_frames": False}))


async def test_a_request_that_leaves_drops_its_video(make_core):
    core = await make_core("qwen2_5_vl", "--video-window", "2", gated=True)
    core.runner.gate.clear()
    waiting = asyncio.create_task(core.encode([], videos=[EVERY_FRAME], wait=True))
    assert await asyncio.to_thread(core.runner.entered.acquire, True, WAIT_S)
    (vf,) = core.videos.video_flights._videos.values()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    core.runner.gate.set()
    with pytest.raises(errors.Unavailable, match="dropped"):
        await asyncio.wait_for(asyncio.shield(vf.task), WAIT_S)
    assert sorted(vf.flights) == [0, 1] and core.engine.queue_depth == 0 and core.engine.permits == 0
    group = vf.video.group_keys()[5]
    with pytest.raises(errors.Unavailable, match="dropped"):
        await core.fetch([FetchItem(group.id, 0)], 0, 1, timeout_s=0)
    again = await core.encode([], videos=[EVERY_FRAME], wait=True)  # encoded again: the failure is forgotten
    assert not again.videos[0].cached  # groups 2 to 5 never ran
    assert (await core.fetch([FetchItem(group.id, 0)], 0, 1, timeout_s=WAIT_S)).rows.shape[0] == 1


async def test_admission_and_pins_are_all_or_none(make_core):
    other = VideoInput(data=make_clip("mp4_h264", frames=4, width=96, height=64), sample_frames=False)
    core = await make_core("qwen2_5_vl", "--max-queue", "3", "--video-window", "2")
    with pytest.raises(errors.Overloaded, match="encode queue is full"):  # two windows of 2 in a queue of 3
        await core.encode([], videos=[EVERY_FRAME, other])
    assert core.engine.permits == 0 and not core.videos.video_flights._videos
    assert core.store.stats()["local_pinned_bytes"] == 0
    # 6 groups x 6 rows x 48 float32 (64x96 frames: 4x6 patches a group): 6.75 KiB a video; three can never be
    # pinned under 16 KiB together, one can.
    core = await make_core("qwen2_5_vl", "--max-pinned-bytes", "16KiB", "--cache-bytes", "1MiB")
    clips = [VideoInput(data=make_clip("mp4_h264", frames=12, width=96, height=64, fps=f), sample_frames=False)
             for f in (24, 25, 30)]
    with pytest.raises(errors.LimitExceeded, match="request's 3 videos"):
        await core.encode([], videos=clips)
    assert core.engine.permits == 0 and core.store.stats()["local_pinned_bytes"] == 0
    (info,) = (await core.encode([], videos=clips[:1], wait=True)).videos
    assert info.num_tokens == 36 and core.store.stats()["local_pinned_bytes"] >= 36 * 48 * 4


async def test_timeout_zero_answers_what_is_cached(make_core):
    core = await make_core("qwen2_5_vl", gated=True)
    core.runner.gate.clear()
    with pytest.raises(errors.DeadlineExceeded, match="videos are not cached yet"):
        await core.encode([], videos=[EVERY_FRAME], wait=True, timeout_s=0)
    (info,) = (await core.encode([], videos=[EVERY_FRAME])).videos
    with pytest.raises(errors.DeadlineExceeded, match="still encoding"):
        await core.fetch([FetchItem(info.group_id(5), 0)], 0, 1, timeout_s=0)
    core.runner.gate.set()


# ---- the decoder the CPU threads share --------------------------------------------------------------------
def _plan_and_frames():
    from encoder_service.preprocessing import iter_frame_groups

    limits = VideoLimits()
    cfg = VideoConfig.from_settings({}, _qwen2_5_spec(), "test")
    plan = plan_video(probe_video(CLIP, limits), cfg, VideoOptions(sample_frames=False), limits)
    return plan, limits, list(iter_frame_groups(CLIP, plan, limits))


def _qwen2_5_spec():
    from tests.support.preprocess_cases import QWEN2_5

    return QWEN2_5


def test_decoder_serves_threads_in_any_order_decoding_once(monkeypatch):
    plan, limits, expected = _plan_and_frames()
    decodes = Decodes(monkeypatch)
    decoder = videos_module.VideoDecoder(CLIP, plan, limits, todo=range(6), keep=6)
    got = {}
    threads = [threading.Thread(target=lambda g=g: got.__setitem__(g, decoder.group(g))) for g in (4, 1, 5, 0, 3, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert sorted(got) == list(range(6)) and decodes.opened == 1 and decodes.yielded == 6
    for g in range(6):
        np.testing.assert_array_equal(got[g], expected[g])


def test_decoder_keeps_at_most_keep_groups_and_restarts_for_one_it_dropped(monkeypatch):
    plan, limits, expected = _plan_and_frames()
    decodes = Decodes(monkeypatch)
    decoder = videos_module.VideoDecoder(CLIP, plan, limits, todo=(0, 1, 3, 4), keep=1)
    np.testing.assert_array_equal(decoder.group(4), expected[4])  # passed 0, 1, 3 (2 is not to do): keeps 3
    np.testing.assert_array_equal(decoder.group(3), expected[3])  # kept
    np.testing.assert_array_equal(decoder.group(0), expected[0])  # dropped: decoded again from the start
    assert decodes.opened == 2
    decoder.close()
    with pytest.raises(errors.Unavailable, match="ended"):
        decoder.group(1)


# ---- keys, ids, answers, settings ---------------------------------------------------------------------------
def test_video_ids_and_keys():
    fp = "f" * 24
    a = video_key([b"clip"], {"frames": [0, 1], "size": [28, 28]}, fp)
    assert a.id.startswith("v:") and len(a.id) == 34 and ":{v:c:blake3:" in a.name
    assert video_key([b"clip"], {"frames": [0, 2], "size": [28, 28]}, fp) != a  # other frames: another video
    assert video_key([b"cl", b"ip"], {"frames": [0, 1], "size": [28, 28]}, fp) != a  # parts are delimited
    for algo in ("xxh3_128", "sha256"):
        assert len(video_key([b"clip"], {}, fp, algo).id) == 34
    g = group_key(a, 3)
    assert (g.id, g.name) == (a.id + "#3", a.name + "#3")
    assert video_key_from_id(g.id, fp) == (a, 3) and video_key_from_id(a.id, fp) == (a, None)
    caller = video_caller_key("clip-1", fp)
    assert caller.id == "v:u:clip-1" and video_key_from_id("v:u:clip-1#0", fp) == (caller, 0)
    for bad in ("v:xyz", "v:u:has space", a.id + "#01", a.id + "#-1", a.id + "#", "v:u:x#1#2"):
        with pytest.raises(errors.InvalidInput, match="malformed id"):
            video_key_from_id(bad, fp)
    assert GROUP_SEP == video_info.GROUP_SEP


def test_video_info_json_and_fetch_items():
    info = video_info.VideoInfo(id="v:u:c", video_grid_thw=(3, 4, 6), num_tokens=18, tokens_per_group=6,
                                num_frames=5, sampled_fps=2.0, second_per_grid_t=None,
                                group_timestamps=(0.25, 1.25, 2.0), row_width=8, hidden_size=2, layout="main",
                                dtype="float32", cached=False)
    assert video_info.VideoInfo.from_json(info.to_json()) == info
    assert info.fetch_items(10) == [("v:u:c#0", 10, 6), ("v:u:c#1", 16, 6), ("v:u:c#2", 22, 6)]
    assert info.fetch_items(offsets=[3, 12, 30])[2] == ("v:u:c#2", 30, 6)
    with pytest.raises(ValueError, match="2 offsets for 3"):
        info.fetch_items(offsets=[1, 2])
    with pytest.raises(ValueError, match="give offset"):
        info.fetch_items()


def test_video_settings_parse_and_refuse():
    s = settings.Settings.from_args(["--model", "m", "--video-codecs", "H264, vp9", "--max-video-bytes", "8MiB"],
                                    env={"ENCODER_VIDEO_WINDOW": "3"})
    assert s.video.video_codecs == ("h264", "vp9") and s.video.max_video_bytes == 8 << 20
    assert s.video.video_window == 3 and s.video.video_containers == settings.VIDEO_CONTAINERS
    for argv, words in ((["--video-codecs", "h264,theora"], "--video-codecs / ENCODER_VIDEO_CODECS"),
                        (["--video-containers", ""], "comma-separated list of mov, matroska"),
                        (["--video-window", "0"], "must be > 0")):
        with pytest.raises(settings.SettingsError, match=words):
            settings.Settings.from_args(["--model", "m", *argv], env={})
