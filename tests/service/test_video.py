"""Videos through the running service (HTTP, gRPC, the Python clients), tiny Qwen2.5-VL and Qwen3-VL: every body
kind answers the plan before the ViT runs; rows fetched frame group by frame group (one run of groups for
Qwen2.5-VL, each group at its own offset for Qwen3-VL) equal the whole video encoded in one call; bad videos
are 400s naming the problem; an id names one video (409); release ends every group's pin; shared-memory
fetch and another replica's wait through a real Redis work for groups as for images.
"""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from encoder_service import errors
from encoder_service.client import VideoSource
from encoder_service.protocol import wire
from tests.support.clients import async_client, sync_client
from tests.support.images import image_bytes
from tests.support.reference import assert_close, reference_video_rows
from tests.support.service import RunningService, make_settings
from tests.support.video_cases import frame_images, make_clip, mp4_claiming_frames

pytestmark = pytest.mark.timeout(180)

CLIP = make_clip("mp4_h264", frames=7, width=128, height=96)  # 7 frames: 4 groups, the last padded
WEBM = make_clip("webm_vp9", frames=5, width=96, height=64)
ALL_FRAMES = {"sample_frames": False}  # every frame (Qwen3-VL samples at 2 fps by default: 4 frames of these)


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def svc(request, service, service_qwen3) -> RunningService:
    return service if request.param == "qwen2_5_vl" else service_qwen3


def http(svc) -> httpx.Client:
    return httpx.Client(base_url=svc.url, timeout=60)


def fetch_video(c: httpx.Client, info: dict, offsets: list[int], start: int, end: int) -> tuple:
    """(header, rows) of the frame groups at `offsets` overlapping [start, end)."""
    items = [{"id": f"{info['id']}#{g}", "offset": at} for g, at in enumerate(offsets)]
    r = c.post("/v1/fetch", json={"items": items, "start": start, "end": end, "timeout_s": 60})
    assert r.status_code == 200, r.text
    return wire.decode_http(r.content)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- encode answers, every body kind -------------------------------------------------------------------
def test_every_body_kind_answers_the_plan(svc):
    frames = frame_images(5, height=64, width=96)
    qwen3 = svc.core.spec.family == "qwen3_vl"
    with http(svc) as c:
        bodies = {
            "json file": c.post("/v1/encode", json={"videos": [{"data": b64(CLIP), **ALL_FRAMES}]}),
            "json frames": c.post("/v1/encode", json={"videos": [{"frames": [b64(f) for f in frames],
                                                                  "frames_fps": 2}]}),
            "multipart file": c.post("/v1/encode?sample_frames=false", files=[("video", ("c.mp4", CLIP, "video/mp4"))]),
            "multipart frames": c.post("/v1/encode?frames_fps=2",
                                       files=[("frame", (f"{i}.png", f, "image/png")) for i, f in enumerate(frames)]),
            "binary video/*": c.post("/v1/encode?sample_frames=false", content=CLIP,
                                     headers={"content-type": "video/mp4"}),
            "binary ?video=true": c.post("/v1/encode?video=true&sample_frames=false", content=CLIP,
                                         headers={"content-type": "application/octet-stream"}),
        }
    for kind, r in bodies.items():
        assert r.status_code == 200, (kind, r.text)
        (info,) = r.json()["videos"]
        t, h, w = info["video_grid_thw"]
        assert info["tokens_per_group"] == h * w // 4 and info["num_tokens"] == t * h * w // 4, kind
        assert info["row_width"] == svc.core.spec.row_width and info["id"].startswith("v:"), kind
        assert (info["group_timestamps"] is not None) == qwen3 and (info["second_per_grid_t"] is None) == qwen3
    file_ids = {bodies[k].json()["videos"][0]["id"] for k in ("json file", "multipart file", "binary video/*",
                                                               "binary ?video=true")}
    assert len(file_ids) == 1  # the same file sampled the same way is one video, whatever carried it
    assert bodies["json frames"].json()["videos"][0]["id"] == bodies["multipart frames"].json()["videos"][0]["id"]
    clip = bodies["json file"].json()["videos"][0]
    assert clip["video_grid_thw"][0] == 4 and clip["num_frames"] == 7  # 7 frames: 4 groups, the last padded
    if qwen3:  # the mean of each group's two frame times at 24 fps; the padded group: frame 6 twice
        assert clip["group_timestamps"] == pytest.approx([0.5 / 24, 2.5 / 24, 4.5 / 24, 6 / 24])
    else:
        assert clip["second_per_grid_t"] == pytest.approx(2 / 24)
        frames_info = bodies["json frames"].json()["videos"][0]
        assert frames_info["sampled_fps"] == 2 and frames_info["second_per_grid_t"] == pytest.approx(1.0)


# ---- rows group by group == the whole video in one call -------------------------------------------------
def test_groups_fetched_chunk_by_chunk_equal_the_whole_video(svc):
    expected = reference_video_rows(svc.checkpoint, CLIP, ALL_FRAMES)
    with http(svc) as c:
        info = c.post("/v1/encode", json={"videos": [{"data": b64(CLIP), **ALL_FRAMES}]}).json()["videos"][0]
        n, per = info["num_tokens"], info["tokens_per_group"]
        if svc.core.spec.family == "qwen3_vl":  # each group after its own text: 3 tokens of timestamp + start
            offsets = [7 + g * (per + 5) for g in range(info["video_grid_thw"][0])]
        else:
            offsets = [7 + g * per for g in range(info["video_grid_thw"][0])]
        end = offsets[-1] + per + 2
        chunk = per // 2 + 3  # boundaries inside groups
        got = {}
        for start in range(0, end, chunk):
            header, rows = fetch_video(c, info, offsets, start, min(start + chunk, end))
            at = 0
            for seg in header.segments:
                g = int(seg.id.rpartition("#")[2])
                assert seg.position == offsets[g] + seg.row_start
                for r in range(seg.row_start, seg.row_end):
                    got[g * per + r] = rows[at + r - seg.row_start]
                at += seg.row_end - seg.row_start
    assert sorted(got) == list(range(n))
    assert_close(torch.stack([got[i] for i in range(n)]), expected)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_clients_encode_and_fetch_videos(svc, transport):
    expected = reference_video_rows(svc.checkpoint, WEBM, ALL_FRAMES)
    with sync_client(svc, transport) as client:
        (info,) = client.encode_videos([WEBM], sample_frames=False)
        items = info.fetch_items(offset=3)
        fetched = client.fetch(items, 0, 3 + info.num_tokens)
        assert [s.id for s in fetched.segments] == [info.group_id(g) for g in range(info.num_groups)]
        assert_close(fetched.rows, expected)
        (again,) = client.encode_videos([VideoSource(data=WEBM, sample_frames=False)], return_embeddings=True)
        assert again.id == info.id and again.cached
        assert_close(again.embedding, expected)
        with pytest.raises(errors.InvalidInput, match="video 0: not a video file"):
            client.encode_videos([b"\0" * 64])
        with pytest.raises(errors.InvalidInput, match="fetch names its frame groups"):
            client.fetch([(info.id, 0)], 0, 4)


@pytest.mark.parametrize("transport", ["http", "grpc"])
async def test_async_clients_encode_frames(service, transport):
    frames = frame_images(3, height=56, width=84)
    expected = reference_video_rows(service.checkpoint, frames, {"frames_fps": 4})
    async with async_client(service, transport) as client:
        (info,) = await client.encode_videos([frames], wait=True, frames_fps=4)
        assert info.num_frames == 3 and info.num_groups == 2 and info.sampled_fps == 4
        assert info.second_per_grid_t == pytest.approx(0.5)
        fetched = await client.fetch(info.fetch_items(offset=0), 0, info.num_tokens)
        assert_close(fetched.rows, expected)


def test_options_change_the_video(service):
    """fps / num_frames / max_pixels give the plan transformers would (preprocessing is tested there): other
    rows, so another id."""
    clip = make_clip("mp4_h264", frames=24, width=128, height=96, fps=24)
    with sync_client(service, "http") as client:
        every, by_fps, by_count, small = client.encode_videos([
            VideoSource(data=clip, sample_frames=False), VideoSource(data=clip, fps=4),
            VideoSource(data=clip, num_frames=6), VideoSource(data=clip, sample_frames=False, max_pixels=4 * 28 * 28)])
    assert every.num_frames == 24 and by_fps.num_frames == 4 and by_count.num_frames == 6
    assert by_fps.sampled_fps == pytest.approx(4.0) and by_fps.second_per_grid_t == pytest.approx(0.5)
    assert small.video_grid_thw[1:] == (2, 4) and every.video_grid_thw[1:] == (6, 10)  # smart_resize in max_pixels
    assert len({every.id, by_fps.id, by_count.id, small.id}) == 4


# ---- errors ----------------------------------------------------------------------------------------------
BAD = {  # name -> (JSON video entry or None for the body below, status, words the message holds)
    "not a video": ({"data": b64(b"\x00" * 64)}, 400, "not a video file"),
    "truncated mp4": ({"data": b64(CLIP[:200])}, 400, "video 0: "),
    "a frame that is no image": ({"frames": [b64(image_bytes(32, 32, 1)), b64(b"junk")]}, 400, "frame 1"),
    "frames of two sizes": ({"frames": [b64(image_bytes(32, 32, 1)), b64(image_bytes(40, 32, 2))]}, 400,
                            "share one size"),
    "fps and num_frames": ({"data": b64(CLIP), "fps": 1, "num_frames": 4}, 400, "mutually exclusive"),
    "bad base64": ({"data": "@@@"}, 400, "video 0: data: not valid base64"),
    "two sources": ({"data": b64(CLIP), "url": "http://x/y.mp4"}, 400, "exactly one of data, frames or url"),
    "url videos off": ({"url": "http://example.com/a.mp4"}, 400, "url videos are disabled"),
    "too many videos": (None, 400, "number of videos in the request"),
    "images and videos": (None, 400, "images or videos, not both"),
    "fps a string": ({"data": b64(CLIP), "fps": "2"}, 400, "fps"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_videos_are_400s_naming_the_problem(service, case):
    entry, status, words = BAD[case]
    body = {"videos": [entry]}
    if case == "too many videos":
        body = {"videos": [{"data": b64(CLIP)}] * 5}
    elif case == "images and videos":
        body = {"videos": [{"data": b64(CLIP)}], "images": [{"data": b64(image_bytes(32, 32, 1))}]}
    with http(service) as c:
        r = c.post("/v1/encode", json=body | {"wait": True})
        assert r.status_code == status, r.text
        assert words in r.json()["error"]["message"], r.text
        assert c.get("/health/ready").status_code == 200


def test_bad_query_options_and_fetch_ids(service):
    with http(service) as c:
        r = c.post("/v1/encode?fps=fast", content=CLIP, headers={"content-type": "video/mp4"})
        assert r.status_code == 400 and "query parameter fps" in r.json()["error"]["message"]
        info = c.post("/v1/encode", content=CLIP, headers={"content-type": "video/mp4"}).json()["videos"][0]
        for bad, words in ((info["id"], "fetch names its frame groups"), (info["id"] + "#x", "malformed id"),
                           ("v:nothex", "malformed id")):
            r = c.post("/v1/fetch", json={"items": [{"id": bad, "offset": 0}], "start": 0, "end": 4})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        r = c.post("/v1/fetch", json={"items": [{"id": info["id"] + "#99", "offset": 0}], "start": 0, "end": 4})
        assert r.status_code == 404, r.text


def test_decode_failure_mid_video_answers_the_fetch(service):
    """A header that claims 12 frames for 7: the first groups land, the encode fails at the missing frame,
    and a fetch of a group after it gets that decode error (400), not a 404."""
    with http(service) as c:
        r = c.post("/v1/encode?sample_frames=false", content=mp4_claiming_frames(12, frames=7, width=64, height=48),
                   headers={"content-type": "video/mp4"})
        info = r.json()["videos"][0]
        assert info["video_grid_thw"][0] == 6
        first = c.post("/v1/fetch", json={"items": [{"id": info["id"] + "#0", "offset": 0}], "start": 0,
                                          "end": info["tokens_per_group"], "timeout_s": 30})
        assert first.status_code == 200, first.text
        r = c.post("/v1/fetch", json={"items": [{"id": info["id"] + "#5", "offset": 0}], "start": 0,
                                      "end": info["tokens_per_group"], "timeout_s": 30})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"encode of id '{info['id']}#5' failed") and "ended after 7 frames" in message


def test_caller_id_names_one_video(service):
    with http(service) as c:  # (an id of its own: the session's service is shared, the README's uses clip-1)
        first = c.post("/v1/encode", json={"videos": [{"data": b64(CLIP), "id": "one-video-id", **ALL_FRAMES}]})
        assert first.status_code == 200 and first.json()["videos"][0]["id"] == "v:u:one-video-id"
        same = c.post("/v1/encode", json={"videos": [{"data": b64(CLIP), "id": "one-video-id", **ALL_FRAMES}]})
        assert same.status_code == 200
        for other in ({"data": b64(WEBM), **ALL_FRAMES}, {"data": b64(CLIP), "num_frames": 4}):
            r = c.post("/v1/encode", json={"videos": [other | {"id": "one-video-id"}]})
            assert r.status_code == 409 and "one-video-id" in r.json()["error"]["message"], r.text
        # An image may use the same caller id: ids of videos are their own namespace (v:u:...).
        r = c.post("/v1/encode", json={"images": [{"data": b64(image_bytes(32, 32, 5)), "id": "one-video-id"}]})
        assert r.status_code == 200 and r.json()["images"][0]["id"] == "u:one-video-id"


def test_release_ends_every_groups_pin(service):
    clip = make_clip("mp4_h264", frames=6, width=96, height=64)
    with sync_client(service, "grpc") as client:
        (info,) = client.encode_videos([clip], wait=True, sample_frames=False)
        groups = [info.group_id(g) for g in range(info.num_groups)]
        assert all(service.pinned(g) for g in groups)
        assert client.release([groups[0]]) == 1 and not service.pinned(groups[0]) and service.pinned(groups[1])
        assert client.release([info.id]) == 1 and not any(service.pinned(g) for g in groups)
        assert client.release([info.id]) == 0


def test_shm_fetch_of_video_groups(shm_service_qwen3):
    svc = shm_service_qwen3
    expected = reference_video_rows(svc.checkpoint, CLIP, ALL_FRAMES)
    with sync_client(svc, "grpc", shm=True, shm_dir=str(svc.settings.server.shm_dir)) as client:
        (info,) = client.encode_videos([CLIP], sample_frames=False)
        offsets = [10 + g * (info.tokens_per_group + 6) for g in range(info.num_groups)]
        end = offsets[-1] + info.tokens_per_group
        out = client.alloc_rows(end, info.row_width, info.dtype)
        for start in range(0, end, 7):
            client.fetch(info.fetch_items(offsets=offsets), start, min(start + 7, end), out=out[start:])
        got = torch.cat([out[at:at + info.tokens_per_group] for at in offsets])
    assert_close(got, expected)


def test_replicas_share_the_groups_through_redis(tiny_checkpoint, redis_server):
    """Replica A encodes (its groups marked pending in Redis before it answers); replica B, which never saw
    the video, answers a fetch of its last group once A's rows land; B encoding the video reads A's groups
    (no encode of its own); a caller id A gave one video is a 409 on B for another."""
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    a = RunningService(make_settings(checkpoint, "--redis-url", redis_server.url, "--video-window", "1"), checkpoint)
    b = RunningService(make_settings(checkpoint, "--redis-url", redis_server.url), checkpoint)
    try:
        expected = reference_video_rows(checkpoint, CLIP, ALL_FRAMES)
        with sync_client(a, "http") as on_a, sync_client(b, "grpc") as on_b:
            (info,) = on_a.encode_videos([VideoSource(data=CLIP, caller_id="shared-clip", sample_frames=False)])
            fetched = on_b.fetch(info.fetch_items(offset=0)[::-1], 0, info.num_tokens)  # the last group first
            assert_close(fetched.rows, expected)
            (again,) = on_b.encode_videos([VideoSource(data=CLIP, caller_id="shared-clip", sample_frames=False)],
                                          return_embeddings=True)
            assert again.id == info.id and b.sample("encoder_images_encoded_total") == 0  # A's groups, from Redis
            assert_close(again.embedding, expected)
            with pytest.raises(errors.Conflict, match="shared-clip.* already names other video bytes"):
                on_b.encode_videos([VideoSource(data=WEBM, caller_id="shared-clip")])
            with pytest.raises(errors.NotFound):
                on_b.fetch([("v:u:never-encoded#0", 0)], 0, 4)
    finally:
        a.close()
        b.close()


def test_metadata_says_how_videos_are_taken(service_qwen3):
    with http(service_qwen3) as c:
        video = c.get("/v1/metadata").json()["video"]
    assert video["processor"] == "Qwen3VLVideoProcessor" and video["fps"] == 2 and video["sample_frames"] is True
    assert video["window"] == 8 and video["containers"] == ["mov", "matroska"] and "h264" in video["codecs"]
