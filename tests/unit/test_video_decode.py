"""Video decoding (preprocessing/video_decode.py): the frames transformers' PyAV reader gives, header-first
limits, lazy group-by-group decoding, and a clear error for every broken or hostile file. Clips are made here
with PyAV (tests/support/video_cases.py)."""

from __future__ import annotations

import dataclasses
import io

import av
import numpy as np
import pytest
from PIL import Image
from transformers.video_utils import read_video_pyav

from encoder_service.errors import ImageDecodeError, LimitExceeded, VideoDecodeError
from encoder_service.preprocessing.limits import VideoLimits
from encoder_service.preprocessing.video import FRAMES, VideoOptions, plan_video
from encoder_service.preprocessing.video_config import VideoConfig
from encoder_service.preprocessing.video_decode import iter_frame_groups, probe_video
from tests.support.preprocess_cases import QWEN2_5, QWEN3, encode, loaded, orientation_exif, rgb_image
from tests.support.video_cases import (
    CLIP_KINDS,
    audio_only_mp4,
    frame_images,
    make_clip,
    mjpeg_claiming_size,
    mkv_without_frames,
    mp4_claiming_frames,
)

LIMITS = VideoLimits()
QWEN2_CFG = VideoConfig.from_settings({}, QWEN2_5, "test")  # no sampling: every frame
QWEN3_CFG = VideoConfig.from_settings({"patch_size": 16}, QWEN3, "test")  # 2 fps, at least 4 frames

EXPECTED_NAMES = {  # clip kind -> (container, codec) as the probe names them
    "mp4_h264": ("mp4", "h264"), "mov_mpeg4": ("mov", "mpeg4"), "webm_vp9": ("webm", "vp9"),
    "webm_vp8": ("webm", "vp8"), "mkv_h264": ("mkv", "h264"), "mkv_mjpeg": ("mkv", "mjpeg"),
    "mp4_hevc": ("mp4", "hevc"), "mp4_av1": ("mp4", "av1"),
}


def all_frames(data: bytes) -> np.ndarray:
    """[N, H, W, 3]: every frame, decoded and converted as transformers' PyAV reader does."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def groups_of(data, cfg, options=VideoOptions(), limits=LIMITS):
    plan = plan_video(probe_video(data, limits), cfg, options, limits)
    return plan, list(iter_frame_groups(data, plan, limits))


def assert_groups_hold_the_sampled_frames(plan, groups, reference: np.ndarray) -> None:
    assert len(groups) == plan.num_groups
    for g, group in enumerate(groups):
        assert group.dtype == np.uint8 and group.shape == (2, *plan.source_size, 3)
        np.testing.assert_array_equal(group, reference[list(plan.group_frames(g))])


@pytest.mark.parametrize("kind", sorted(CLIP_KINDS))
def test_every_kind_of_clip(kind):
    data = make_clip(kind, frames=7)
    probe = probe_video(data, LIMITS)
    assert (probe.container, probe.codec) == EXPECTED_NAMES[kind]
    assert (probe.width, probe.height, probe.total_frames, probe.fps) == (64, 48, 7, 24.0)
    assert probe.duration_s == 7 / 24
    reference = all_frames(data)
    for cfg in (QWEN2_CFG, QWEN3_CFG):
        plan, groups = groups_of(data, cfg)
        assert_groups_hold_the_sampled_frames(plan, groups, reference)


def test_frames_and_metadata_are_transformers_pyav_readers():
    """transformers' read_video_pyav on the same file: same frame count, fps and frames."""
    data = make_clip("mp4_h264", frames=30, width=96, height=64)
    plan, groups = groups_of(data, QWEN3_CFG, VideoOptions(fps=8))
    frames, metadata = read_video_pyav(io.BytesIO(data), lambda metadata: np.asarray(plan.frame_indices))
    probe = probe_video(data, LIMITS)
    assert (probe.total_frames, probe.fps, probe.width, probe.height) == (
        metadata.total_num_frames, metadata.fps, metadata.width, metadata.height)
    padded = np.concatenate([frames, frames[-1:]]) if len(frames) % 2 else frames
    np.testing.assert_array_equal(np.concatenate(groups), padded)


def test_decoder_threads_do_not_change_frames():
    data = make_clip("mp4_h264", frames=12, width=160, height=96)
    one = groups_of(data, QWEN2_CFG, limits=VideoLimits(decoder_threads=1))[1]
    four = groups_of(data, QWEN2_CFG, limits=VideoLimits(decoder_threads=4))[1]
    np.testing.assert_array_equal(np.stack(one), np.stack(four))


def test_repeated_and_padded_frames():
    """Qwen3 with more frames asked for than there are repeats frames; an odd count repeats the last."""
    data = make_clip("mkv_h264", frames=3)
    plan, groups = groups_of(data, QWEN3_CFG, VideoOptions(num_frames=5))
    assert plan.frame_indices == (0, 0, 1, 2, 2) and plan.padded_indices == (0, 0, 1, 2, 2, 2)
    assert_groups_hold_the_sampled_frames(plan, groups, all_frames(data))


def test_groups_are_decoded_lazily_in_order():
    """A header that claims 9 frames for 7: the first groups come out before the missing frame is reached."""
    data = mp4_claiming_frames(9, frames=7)
    plan = plan_video(probe_video(data, LIMITS), QWEN2_CFG, VideoOptions(), LIMITS)
    groups = iter_frame_groups(data, plan, LIMITS)
    reference = all_frames(data)
    for g in range(3):
        np.testing.assert_array_equal(next(groups), reference[list(plan.group_frames(g))])
    with pytest.raises(VideoDecodeError, match="ended after 7 frames, but frame 8 was sampled"):
        next(groups)


def test_decoding_stops_after_the_last_sampled_frame():
    """Frames past the last one sampled are never decoded: missing ones are no error then."""
    data = mp4_claiming_frames(20, frames=7)
    plan = plan_video(probe_video(data, LIMITS), QWEN2_CFG, VideoOptions(), LIMITS)
    plan = dataclasses.replace(plan, frame_indices=(0, 2, 3, 6), grid_thw=(2, *plan.grid_thw[1:]))
    assert_groups_hold_the_sampled_frames(plan, list(iter_frame_groups(data, plan, LIMITS)), all_frames(data))


def test_a_video_can_be_dropped_midway():
    data = make_clip("mp4_h264", frames=8)
    plan = plan_video(probe_video(data, LIMITS), QWEN2_CFG, VideoOptions(), LIMITS)
    groups = iter_frame_groups(data, plan, LIMITS)
    next(groups)
    groups.close()  # the engine drops a video mid-way: no error (the generator's finally closes the file)
    with pytest.raises(StopIteration):
        next(groups)


# ---- broken and hostile files ----


BAD_VIDEOS = {  # name -> (bytes maker, error type, message fragment)
    "empty": (lambda: b"", VideoDecodeError, "not a video file"),
    "text": (lambda: b"just some text, no video here" * 4, VideoDecodeError, "not a video file"),
    "png_image": (lambda: encode(rgb_image(48, 64), "PNG"), VideoDecodeError, "not a video file"),
    "ftyp_then_garbage": (lambda: b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 4, VideoDecodeError,
                          "cannot read the mp4 file"),
    "ebml_then_garbage": (lambda: b"\x1aE\xdf\xa3" + bytes(1000), VideoDecodeError, "mkv"),
    "truncated_mp4": (lambda: make_clip("mp4_h264")[:4000], VideoDecodeError, "cannot read the mp4 file"),
    "audio_only": (audio_only_mp4, VideoDecodeError, "no video stream .streams: audio"),
    "no_frames": (mkv_without_frames, VideoDecodeError, "ends before its first frame"),
    "claims_ten_hours": (lambda: mp4_claiming_frames(24 * 36000), LimitExceeded,
                         "frame count of the video is 864000, over the limit of 36000"),
}


@pytest.mark.parametrize("name", sorted(BAD_VIDEOS))
def test_bad_files_are_clear_errors(name):
    make, error, message = BAD_VIDEOS[name]
    with pytest.raises(error, match=message):
        probe_video(make(), LIMITS)


def test_ten_hours_is_over_the_duration_limit_too():
    limits = VideoLimits(max_source_frames=10**7, max_decoded_pixels=10**15)
    with pytest.raises(LimitExceeded, match="duration of the video in seconds is 36000.0, over the limit of 600"):
        probe_video(mp4_claiming_frames(24 * 36000), limits)


def test_truncated_after_its_index():
    """An MP4 whose index comes first, cut inside its frames: opens, then the stream ends early."""
    data = make_clip("mp4_h264", frames=7, faststart=True)
    cut = data[: len(data) - 6000]
    plan = plan_video(probe_video(cut, LIMITS), QWEN2_CFG, VideoOptions(), LIMITS)
    with pytest.raises(VideoDecodeError, match="video ended after|cannot decode frame"):
        list(iter_frame_groups(cut, plan, LIMITS))


def test_frames_that_claim_huge_sizes():
    """JPEG frames whose headers say 30000x30000 inside a 64x48 Matroska stream: an error, nothing allocated."""
    data = mjpeg_claiming_size(30000, 30000)
    plan = plan_video(probe_video(data, LIMITS), QWEN2_CFG, VideoOptions(), LIMITS)
    with pytest.raises(VideoDecodeError, match="cannot decode frame 0 of the mkv video"):
        list(iter_frame_groups(data, plan, LIMITS))


@pytest.mark.parametrize("limits, error, message", [
    (VideoLimits(max_bytes=1000), LimitExceeded, "encoded video size in bytes"),
    (VideoLimits(max_frame_pixels=64 * 47), LimitExceeded, "pixel count of the video's 64x48 frames is 3072"),
    (VideoLimits(max_source_frames=6), LimitExceeded, "frame count of the video is 7, over the limit of 6"),
    (VideoLimits(max_duration_s=0.25), LimitExceeded, "duration of the video in seconds is 0.292"),
    (VideoLimits(max_decoded_pixels=6 * 64 * 48), LimitExceeded, r"decoded pixel count of the video \(7 frames"),
    (VideoLimits(containers=("matroska",)), VideoDecodeError, "mp4 videos are not accepted"),
    (VideoLimits(codecs=("vp9",)), VideoDecodeError, "h264 video is not accepted"),
])
def test_limits_from_the_header(limits, error, message):
    with pytest.raises(error, match=message):
        probe_video(make_clip("mp4_h264", frames=7), limits)


def test_matroska_frame_count_is_bounded_while_counting():
    with pytest.raises(LimitExceeded, match="frame count of the video is over 5"):
        probe_video(make_clip("mkv_h264", frames=7), VideoLimits(max_source_frames=5))


# ---- frames given as images ----


def test_frames_given_as_images():
    frames = frame_images(5)
    probe = probe_video(frames, LIMITS, frames_fps=2.0)
    assert (probe.container, probe.codec, probe.total_frames, probe.fps) == (FRAMES, "PNG", 5, 2.0)
    plan, groups = groups_of(frames, QWEN3_CFG)
    assert plan.frame_indices == (0, 1, 2, 3, 4)  # a list of frames is not sampled unless asked
    reference = np.stack([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in frames])
    assert_groups_hold_the_sampled_frames(plan, groups, reference)


@pytest.mark.parametrize("exif_orientation", [True, False])
def test_frames_given_as_images_are_turned_upright_as_images(exif_orientation):
    """Frames with an EXIF orientation (phone photos) are sized and decoded upright, as images are, unless the
    setting is off (--no-exif-orientation: as stored)."""
    frames = [encode(rgb_image(48, 64, seed=i), "JPEG", quality=95, exif=orientation_exif(6)) for i in range(4)]
    limits = dataclasses.replace(LIMITS, exif_orientation=exif_orientation)
    probe = probe_video(frames, limits)
    assert (probe.width, probe.height) == ((48, 64) if exif_orientation else (64, 48))
    plan, groups = groups_of(frames, QWEN3_CFG, limits=limits)
    reference = np.stack([np.asarray(loaded(f, exif_orientation).convert("RGB")) for f in frames])
    assert_groups_hold_the_sampled_frames(plan, groups, reference)


@pytest.mark.parametrize("frames, message", [
    ([], "no frames"),
    ("not a list", "not str"),
])
def test_bad_frame_lists(frames, message):
    with pytest.raises(VideoDecodeError, match=message):
        probe_video(frames, LIMITS)


def test_frames_of_different_sizes():
    frames = frame_images(3) + [encode(rgb_image(50, 64), "PNG")]
    with pytest.raises(VideoDecodeError, match="frame 3 is 64x50, frame 0 is 64x48"):
        probe_video(frames, LIMITS)


def test_a_frame_that_is_no_image_names_its_index():
    with pytest.raises(ImageDecodeError, match="^frame 2: not an image"):
        probe_video(frame_images(2) + [b"garbage"], LIMITS)


def test_frame_list_limits():
    with pytest.raises(LimitExceeded, match="frame 0: decoded pixel count"):
        probe_video(frame_images(2), VideoLimits(max_frame_pixels=100))
    with pytest.raises(LimitExceeded, match="frame count of the video is 3"):
        probe_video(frame_images(3), VideoLimits(max_source_frames=2))
    with pytest.raises(LimitExceeded, match="encoded size in bytes of the video's frames"):
        probe_video(frame_images(3), VideoLimits(max_bytes=100))


def test_frames_fps_only_for_frame_lists():
    with pytest.raises(VideoDecodeError, match="frames_fps is for a list of frames"):
        probe_video(make_clip(), LIMITS, frames_fps=10)
    with pytest.raises(VideoDecodeError, match="frames_fps must be a positive number"):
        probe_video(frame_images(2), LIMITS, frames_fps=0)
