"""A video's plan (preprocessing/video.py) and video config (video_config.py): sampling, sizes, grids and the
language model's metadata, against the parts of transformers' video processing that import without
torchvision (Qwen3-VL's sampling and smart_resize, Qwen3VLProcessor's timestamps, VideoMetadata's sampled fps).
Qwen2-VL's video processor module imports torchvision: its sampling is checked against transformers in
tests/engines/test_torchvision_video.py (with the pixel values), here against its formula's known values.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_smart_resize
from transformers.video_utils import VideoMetadata

from encoder_service.errors import InvalidInput, LimitExceeded, ModelLoadError
from encoder_service.preprocessing.limits import VideoLimits
from encoder_service.preprocessing.video import (
    FRAMES,
    VideoOptions,
    VideoProbe,
    plan_video,
    preprocess_group,
    smart_resize_frames,
    timestamp_text,
)
from encoder_service.preprocessing.video_config import QWEN2_VIDEO, QWEN3_VIDEO, VideoConfig
from tests.support.preprocess_cases import CLIP_MEAN, CLIP_STD, HUB_CONFIGS, QWEN2_5, QWEN3, write_checkpoint

LIMITS = VideoLimits()
# What the published checkpoints hold: Qwen2.5-VL's image file (its videos use it), Qwen3-VL's video file.
QWEN2_5_VIDEO_SETTINGS = HUB_CONFIGS["qwen2_5"][1]
QWEN3_VIDEO_SETTINGS = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                        "video_processor_type": QWEN3_VIDEO}


def qwen2_5_config(**settings) -> VideoConfig:
    return VideoConfig.from_settings(QWEN2_5_VIDEO_SETTINGS | settings, QWEN2_5, "test")


def qwen3_config(**settings) -> VideoConfig:
    return VideoConfig.from_settings(QWEN3_VIDEO_SETTINGS | settings, QWEN3, "test")


def probe(total=30, fps=24.0, height=480, width=640, container="mp4") -> VideoProbe:
    duration = None if fps is None else total / fps
    return VideoProbe(width, height, total, fps, duration, container, "h264")


# ---- sampling ----


QWEN3_SAMPLING = [  # (total frames, source fps, options)
    (30, 24.0, VideoOptions()),  # 2 fps of 1.25 s: 2 frames, raised to min_frames 4
    (3600, 30.0, VideoOptions()),  # 2 minutes at 2 fps: 240
    (100000, 30.0, VideoOptions()),  # over max_frames: 768
    (3, 24.0, VideoOptions()),  # fewer than min_frames: all 3
    (250, 29.97, VideoOptions(fps=1.5)),
    (250, None, VideoOptions()),  # unknown rate: 24 assumed
    (10, 24.0, VideoOptions(num_frames=16)),  # more than there are: linspace repeats frames
    (97, 25.0, VideoOptions(num_frames=7)),
]


@pytest.mark.parametrize("total, fps, options", QWEN3_SAMPLING)
def test_qwen3_sampling_matches_transformers(total, fps, options):
    cfg = qwen3_config()
    plan = plan_video(probe(total, fps), cfg, options, LIMITS)
    processor = SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    metadata = VideoMetadata(total_num_frames=total, fps=fps)
    # transformers' call: the caller's fps or num_frames, the other one None.
    requested = {"fps": None, "num_frames": options.num_frames} if options.num_frames else {"fps": options.fps}
    expected = Qwen3VLVideoProcessor.sample_frames(processor, metadata, **requested)
    assert plan.frame_indices == tuple(expected.tolist())
    assert plan.fps == metadata.fps  # 24 written into the metadata when unknown
    metadata.frames_indices = expected
    assert plan.sampled_fps == metadata.sampled_fps
    assert plan.group_timestamps == tuple(Qwen3VLProcessor._calculate_timestamps(None, expected, metadata.fps, 2))


QWEN2_SAMPLING = [  # (total, source fps, options, indices as transformers' formula gives them)
    (10, 24.0, VideoOptions(num_frames=4), (0, 2, 5, 7)),  # arange(0, 10, 2.5).int()
    (7, 24.0, VideoOptions(num_frames=6), (0, 1, 2, 3, 4, 5)),  # step 7/6
    (9, 24.0, VideoOptions(num_frames=3), (0, 2, 4, 6)),  # 3 frames rounded to 4 (round half to even: 2 * 2)
    (48, 24.0, VideoOptions(fps=2), (0, 12, 24, 36)),  # 4 frames: 2 s at 2 fps
    (48, 24.0, VideoOptions(fps=0.5), (0, 12, 24, 36)),  # 1 frame raised to min_frames 4
    (5, 24.0, VideoOptions(fps=24), (0, 1, 2, 3)),  # at most the frame count, floored to even
]


@pytest.mark.parametrize("total, fps, options, expected", QWEN2_SAMPLING)
def test_qwen2_sampling(total, fps, options, expected):
    plan = plan_video(probe(total, fps), qwen2_5_config(), options, LIMITS)
    assert plan.frame_indices == expected
    assert plan.sampled_fps == len(expected) / total * fps
    assert plan.second_per_grid_t == 2 / plan.sampled_fps


def test_qwen2_takes_every_frame_by_default():
    plan = plan_video(probe(total=7), qwen2_5_config(), VideoOptions(), LIMITS)
    assert plan.frame_indices == tuple(range(7))
    assert plan.num_groups == 4 and plan.group_frames(3) == (6, 6)  # odd: the last frame repeated
    assert plan.second_per_grid_t == 2 / 24.0


@pytest.mark.parametrize("cfg, options, message", [
    (qwen2_5_config(), VideoOptions(sample_frames=True), "needs fps or num_frames"),
    (qwen2_5_config(), VideoOptions(num_frames=40), "cannot sample 40 frames"),
    (qwen2_5_config(), VideoOptions(num_frames=1), "no frames"),  # rounds to 0
])
def test_qwen2_sampling_requests_transformers_refuses(cfg, options, message):
    with pytest.raises(InvalidInput, match=message):
        plan_video(probe(total=30), cfg, options, LIMITS)


def test_qwen2_sampling_at_an_fps_needs_the_source_rate():
    with pytest.raises(InvalidInput, match="frame rate"):
        plan_video(probe(total=30, fps=None), qwen2_5_config(), VideoOptions(fps=1), LIMITS)


def test_unknown_rate_is_24_fps_as_transformers_assumes():
    plan = plan_video(probe(total=6, fps=None), qwen2_5_config(), VideoOptions(), LIMITS)
    assert plan.sampled_fps == VideoMetadata(total_num_frames=6, fps=None, frames_indices=None).sampled_fps == 24
    assert plan.group_timestamps == tuple(Qwen3VLProcessor._calculate_timestamps(None, list(range(6)), 24, 2))


def test_frame_lists_are_not_sampled_unless_asked():
    frames = probe(total=10, fps=None, container=FRAMES)
    assert plan_video(frames, qwen3_config(), VideoOptions(), LIMITS).frame_indices == tuple(range(10))
    sampled = plan_video(frames, qwen3_config(), VideoOptions(sample_frames=True), LIMITS)
    assert sampled.frame_indices == (0, 3, 6, 9)  # 2 fps of 10 frames at an assumed 24: min_frames 4


@pytest.mark.parametrize("kwargs, message", [
    ({"fps": 1, "num_frames": 4}, "mutually exclusive"),
    ({"fps": 0}, "positive number"),
    ({"fps": float("nan")}, "positive number"),
    ({"fps": True}, "positive number"),
    ({"num_frames": 0}, "positive integer"),
    ({"num_frames": 2.5}, "positive integer"),
    ({"max_pixels": -1}, "positive integer"),
    ({"min_pixels": 100, "max_pixels": 10}, "over max_pixels"),
    ({"sample_frames": False, "fps": 2}, "need sample_frames"),
])
def test_options_are_checked(kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        VideoOptions(**kwargs)


# ---- sizes, grids, metadata ----


@pytest.mark.parametrize("frames", [2, 3, 7, 64, 768])
@pytest.mark.parametrize("height, width", [(480, 640), (1080, 1920), (20, 900), (31, 10), (2160, 3840)])
@pytest.mark.parametrize("bounds", [(4096, 25165824), (128 * 32 * 32, 32 * 32 * 768), (4096, 65536)])
def test_qwen3_smart_resize_matches_transformers(frames, height, width, bounds):
    ours = smart_resize_frames(frames, height, width, 2, 32, *bounds)
    assert ours == qwen3_smart_resize(frames, height, width, 2, 32, *bounds)


def test_qwen3_needs_two_frames():
    with pytest.raises(InvalidInput, match="at least 2 frames"):
        plan_video(probe(total=1), qwen3_config(), VideoOptions(), LIMITS)


def test_qwen3_budget_is_over_all_frames():
    """size.longest_edge bounds every sampled frame together: more frames, smaller frames."""
    cfg = qwen3_config(size={"shortest_edge": 4096, "longest_edge": 4 * 480 * 640})
    few = plan_video(probe(total=96), cfg, VideoOptions(num_frames=4), LIMITS)
    many = plan_video(probe(total=96), cfg, VideoOptions(num_frames=64), LIMITS)
    assert few.grid_thw == (2, 30, 40)  # 4 frames of 480x640 fit
    assert many.grid_thw == (32, 6, 10)  # 16 times the frames: sides / 4 (120x160), floored to 32: 96x160


def test_qwen2_bounds_are_per_frame():
    cfg = qwen2_5_config()
    assert plan_video(probe(total=4), cfg, VideoOptions(), LIMITS).grid_thw == (2, 34, 46)  # 476 x 644
    small = plan_video(probe(total=4), cfg, VideoOptions(max_pixels=100_000), LIMITS)
    assert small.resized_height * small.resized_width <= 100_000 and small.grid_thw[0] == 2


def test_cap_pixels_per_frame():
    """qwen-vl-utils' cap (transformers' cap_pixels_per_frame): Qwen2's per-frame share of 90% of
    max_video_tokens' pixels; Qwen3's min(max_video_tokens per frame, budget / frames)."""
    cfg = qwen2_5_config(cap_pixels_per_frame=True, max_video_tokens=2000)
    plan = plan_video(probe(total=40), cfg, VideoOptions(), LIMITS)
    cap = max(min(12845056, int(2000 * 28 * 28 * 0.9) * 2 // 40), int(3136 * 1.05))
    assert plan.resized_height * plan.resized_width <= cap < 480 * 640
    cfg = qwen3_config(cap_pixels_per_frame=True, max_video_tokens=16)
    plan = plan_video(probe(total=40), cfg, VideoOptions(num_frames=40), LIMITS)
    assert plan.resized_height * plan.resized_width <= 16 * 32 * 32


def test_grid_tokens_and_groups():
    plan = plan_video(probe(total=5, height=56, width=84), qwen2_5_config(), VideoOptions(), LIMITS)
    assert plan.grid_thw == (3, 4, 6) and plan.group_grid == (1, 4, 6)
    assert plan.tokens_per_group == 6 and plan.num_tokens == 18
    assert [plan.group_frames(g) for g in range(3)] == [(0, 1), (2, 3), (4, 4)]
    assert plan.frames_to_decode == 5 and plan.source_size == (56, 84)


def test_timestamp_text():
    assert timestamp_text(0.5 / 24) == "<0.0 seconds>"
    assert timestamp_text(12.25) == "<12.2 seconds>"  # Python's format: 12.25 is below 12.25 in binary


# ---- limits ----


def test_sampled_frames_over_the_limit():
    limits = VideoLimits(max_frames=16)
    with pytest.raises(LimitExceeded, match="sampled frame count is 30, over the limit of 16"):
        plan_video(probe(total=30), qwen2_5_config(), VideoOptions(), limits)
    assert plan_video(probe(total=30), qwen2_5_config(), VideoOptions(num_frames=16), limits).grid_thw[0] == 8


def test_tokens_over_the_limit():
    with pytest.raises(LimitExceeded, match="token count of the video"):
        plan_video(probe(total=30), qwen2_5_config(), VideoOptions(), VideoLimits(max_tokens=1000))


def test_aspect_ratio_over_200():
    for cfg in (qwen2_5_config(), qwen3_config()):
        with pytest.raises(LimitExceeded, match="aspect ratio"):
            plan_video(probe(total=4, height=2, width=2000), cfg, VideoOptions(), LIMITS)


def test_video_limits_validate_themselves():
    with pytest.raises(ValueError):
        VideoLimits(max_frames=0)
    with pytest.raises(ValueError):
        VideoLimits(codecs=("h264", "prores"))


# ---- the checkpoint's video settings ----


def test_qwen2_5_videos_use_the_image_file(tmp_path):
    """No video file: the image file's min_pixels / max_pixels bound each frame (what Qwen2.5-VL publishes)."""
    cfg = VideoConfig.from_checkpoint(write_checkpoint(tmp_path, QWEN2_5_VIDEO_SETTINGS), QWEN2_5)
    assert cfg.processor == QWEN2_VIDEO and not cfg.do_sample_frames and cfg.fps is None
    assert (cfg.pixels.min_pixels, cfg.pixels.max_pixels) == (3136, 12845056)
    assert cfg.pixels.image_mean == tuple(CLIP_MEAN) and cfg.pixels.image_std == tuple(CLIP_STD)


def test_video_file_and_processor_config_take_precedence(tmp_path):
    write_checkpoint(tmp_path, QWEN2_5_VIDEO_SETTINGS)
    write_checkpoint(tmp_path, {**QWEN2_5_VIDEO_SETTINGS, "max_pixels": 200704}, "video_preprocessor_config.json")
    assert VideoConfig.from_checkpoint(tmp_path, QWEN2_5).pixels.max_pixels == 200704
    nested = {"image_processor": QWEN2_5_VIDEO_SETTINGS, "video_processor": {**QWEN2_5_VIDEO_SETTINGS, "fps": 1}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert VideoConfig.from_checkpoint(tmp_path, QWEN2_5).fps == 1


def test_qwen3_video_file(tmp_path):
    cfg = VideoConfig.from_checkpoint(write_checkpoint(tmp_path, QWEN3_VIDEO_SETTINGS,
                                                       "video_preprocessor_config.json"), QWEN3)
    assert cfg.processor == QWEN3_VIDEO and cfg.do_sample_frames and cfg.fps == 2
    assert (cfg.min_frames, cfg.max_frames, cfg.max_video_tokens) == (4, 768, 768)
    assert (cfg.pixels.min_pixels, cfg.pixels.max_pixels) == (4096, 25165824)


def test_qwen3_ignores_min_and_max_pixels_keys():
    """Qwen3VLVideoProcessor's __init__ has no min_pixels / max_pixels override: `size` decides."""
    cfg = qwen3_config(min_pixels=1, max_pixels=2)
    assert (cfg.pixels.min_pixels, cfg.pixels.max_pixels) == (4096, 25165824)
    assert qwen2_5_config(max_pixels=200704).pixels.max_pixels == 200704


def test_which_processor_class():
    """video_processor_type, else image_processor_type renamed where that is a class, else the model type."""
    image_file = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16}
    assert VideoConfig.from_settings(image_file, QWEN3, "t").processor == QWEN2_VIDEO
    assert VideoConfig.from_settings({"patch_size": 16}, QWEN3, "t").processor == QWEN3_VIDEO
    renamed_to_nothing = {"image_processor_type": "Qwen2VLImageProcessorPil", "patch_size": 16}
    assert VideoConfig.from_settings(renamed_to_nothing, QWEN3, "t").processor == QWEN3_VIDEO
    assert VideoConfig.from_settings({}, QWEN2_5, "t").processor == QWEN2_VIDEO


def test_class_defaults_when_the_file_is_silent():
    cfg = VideoConfig.from_settings({}, QWEN3, "t")
    assert (cfg.pixels.min_pixels, cfg.pixels.max_pixels) == (128 * 32 * 32, 32 * 32 * 768)
    assert cfg.pixels.image_mean == (0.5, 0.5, 0.5)
    cfg = VideoConfig.from_settings({}, QWEN2_5, "t")
    assert (cfg.pixels.min_pixels, cfg.pixels.max_pixels) == (128 * 28 * 28, 28 * 28 * 768)


def test_tiny_checkpoints_have_their_family_video_settings(tiny_checkpoint, loaded):
    for family, processor in (("qwen2_5_vl", QWEN2_VIDEO), ("qwen3_vl", QWEN3_VIDEO)):
        cfg = VideoConfig.from_checkpoint(tiny_checkpoint(family), loaded(family).spec)
        assert cfg.processor == processor


@pytest.mark.parametrize("settings, message", [
    ({"video_processor_type": "LlavaOnevisionVideoProcessor"}, "not supported"),
    ({"fps": 2, "num_frames": 8}, "both set"),
    ({"fps": -1}, "positive float"),
    ({"num_frames": 2.5}, "positive int"),
    ({"do_sample_frames": "yes"}, "true or false"),
    ({"patch_size": 16}, "patch_size is 16"),
    ({"do_normalize": False}, "do_normalize"),
])
def test_config_rejects(settings, message):
    with pytest.raises(ModelLoadError, match=message):
        VideoConfig.from_settings(QWEN2_5_VIDEO_SETTINGS | settings, QWEN2_5, "t")


def test_preprocess_group_checks_its_frames():
    plan = plan_video(probe(total=4, height=56, width=84), qwen2_5_config(), VideoOptions(), LIMITS)
    rows = preprocess_group(torch.zeros(2, 56, 84, 3, dtype=torch.uint8), plan, qwen2_5_config())
    assert rows.shape == (4 * 6, 3 * 2 * 14 * 14) and rows.dtype == torch.float32
    with pytest.raises(ValueError, match="frames must be"):
        preprocess_group(torch.zeros(2, 56, 80, 3, dtype=torch.uint8), plan, qwen2_5_config())
