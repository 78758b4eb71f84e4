"""Our video preprocessing equals transformers' video processors (`Qwen2VLVideoProcessor`,
`Qwen3VLVideoProcessor`, torchvision) on the CPU, given the same decoded frames and metadata: pixel values
bit for bit (torch.equal, every frame group concatenated), video_grid_thw, the sampled frames, and what the
language model is given (Qwen2.5-VL's second_per_grid_ts, Qwen3-VL's timestamped prompt), from the same
checkpoint files. transformers samples the frames from the whole decoded video; we decode only the sampled
ones, group by group.

The torchvision tier: run in its own venv by scripts/tiers/torchvision.sh; skipped in the main venv.
"""

from __future__ import annotations

import io
import json

import av
import numpy as np
import pytest
import torch
from PIL import Image

from tests.support.engine_tier import require

require("torchvision", "scripts/tiers/torchvision.sh")

from transformers import AutoVideoProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor  # noqa: E402

from encoder_service.errors import InvalidInput  # noqa: E402
from encoder_service.preprocessing.limits import VideoLimits  # noqa: E402
from encoder_service.preprocessing.video import (  # noqa: E402
    VideoOptions,
    plan_video,
    preprocess_group,
    timestamp_text,
)
from encoder_service.preprocessing.video_config import QWEN2_VIDEO, QWEN3_VIDEO, VideoConfig  # noqa: E402
from encoder_service.preprocessing.video_decode import iter_frame_groups, probe_video  # noqa: E402
from tests.support.preprocess_cases import HUB_CONFIGS, QWEN2_5, QWEN3, write_checkpoint  # noqa: E402
from tests.support.video_cases import frame_images, make_clip  # noqa: E402

LIMITS = VideoLimits()

QWEN3_VIDEO_FILE = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                    "video_processor_type": "Qwen3VLVideoProcessor"}
# name -> (spec, model_type, {file name: settings}): the published layouts, and small budgets that make the
# processors downscale (and Qwen2.5's upscale) our small clips.
CHECKPOINTS = {
    "qwen2_5_published": (QWEN2_5, "qwen2_5_vl", {"preprocessor_config.json": HUB_CONFIGS["qwen2_5"][1]}),
    "qwen2_5_small": (QWEN2_5, "qwen2_5_vl", {"preprocessor_config.json": HUB_CONFIGS["qwen2_5"][1] | {
        "min_pixels": 40 * 28 * 28, "max_pixels": 60 * 28 * 28}}),
    "qwen2_5_capped": (QWEN2_5, "qwen2_5_vl", {
        "video_preprocessor_config.json": HUB_CONFIGS["qwen2_5"][1] | {
            "video_processor_type": "Qwen2VLVideoProcessor", "cap_pixels_per_frame": True,
            "max_video_tokens": 200}}),
    "qwen3_published": (QWEN3, "qwen3_vl", {"preprocessor_config.json": HUB_CONFIGS["qwen3"][1],
                                            "video_preprocessor_config.json": QWEN3_VIDEO_FILE}),
    "qwen3_small_budget": (QWEN3, "qwen3_vl", {"video_preprocessor_config.json": QWEN3_VIDEO_FILE | {
        "size": {"longest_edge": 6 * 32 * 32 * 4, "shortest_edge": 4096}}}),
    "qwen3_capped": (QWEN3, "qwen3_vl", {"video_preprocessor_config.json": QWEN3_VIDEO_FILE | {
        "cap_pixels_per_frame": True, "max_video_tokens": 8}}),
}

CLIPS = {  # name -> clip maker (frames decoded by PyAV in both pipelines)
    "mp4_h264_7_frames": lambda: make_clip("mp4_h264", frames=7, width=96, height=72),
    "webm_vp9_30_frames": lambda: make_clip("webm_vp9", frames=30, width=80, height=60, fps=30),
    "mkv_h264_odd_size": lambda: make_clip("mkv_h264", frames=9, width=90, height=50, fps=10),
}

OPTIONS = {  # name -> (ours, transformers' call kwargs)
    "default": (VideoOptions(), {}),
    "fps_4": (VideoOptions(fps=4), {"do_sample_frames": True, "fps": 4}),
    "num_frames_5": (VideoOptions(num_frames=5), {"do_sample_frames": True, "num_frames": 5, "fps": None}),
    "all_frames": (VideoOptions(sample_frames=False), {"do_sample_frames": False}),
    "size": (VideoOptions(min_pixels=2048, max_pixels=20000),
             {"size": {"shortest_edge": 2048, "longest_edge": 20000}}),
}


def checkpoint(tmp_path, name):
    spec, model_type, files = CHECKPOINTS[name]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    for filename, settings in files.items():
        write_checkpoint(tmp_path, settings, filename)
    return spec, VideoConfig.from_checkpoint(tmp_path, spec), AutoVideoProcessor.from_pretrained(tmp_path)


@pytest.fixture(params=sorted(CHECKPOINTS), scope="module")
def family(request, tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def decoded(data: bytes) -> np.ndarray:
    """[N, H, W, 3] every frame, as transformers' PyAV reader decodes and converts them."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def ours(video, cfg, options, **probe_args):
    probe = probe_video(video, LIMITS, **probe_args)
    plan = plan_video(probe, cfg, options, LIMITS)
    groups = [preprocess_group(frames, plan, cfg) for frames in iter_frame_groups(video, plan, LIMITS)]
    return probe, plan, torch.cat(groups)


def assert_equal_to(reference, plan, pixel_values):
    assert tuple(reference["video_grid_thw"][0].tolist()) == plan.grid_thw
    expected = reference["pixel_values_videos"]
    assert pixel_values.dtype == expected.dtype == torch.float32
    assert pixel_values.shape == expected.shape
    max_diff = (pixel_values - expected).abs().max().item()
    assert torch.equal(pixel_values, expected), f"max abs diff {max_diff}"


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_clips_match_transformers(clip, options, family):
    spec, cfg, processor = family
    our_options, their_kwargs = OPTIONS[options]
    data = CLIPS[clip]()
    probe, plan, pixel_values = ours(data, cfg, our_options)
    # As transformers' own readers fill it in (frames_indices: every frame; sampling replaces them).
    metadata = {"total_num_frames": probe.total_frames, "fps": probe.fps, "width": probe.width,
                "height": probe.height, "duration": probe.duration_s, "frames_indices": list(range(probe.total_frames))}
    frames = decoded(data)
    assert len(frames) == probe.total_frames
    reference = processor(frames, video_metadata=metadata, return_metadata=True, return_tensors="pt", device="cpu",
                          **their_kwargs)
    assert_equal_to(reference, plan, pixel_values)
    their_metadata = reference["video_metadata"][0]
    if their_metadata.frames_indices is not None:
        assert tuple(int(i) for i in their_metadata.frames_indices) == plan.frame_indices
    assert their_metadata.sampled_fps == plan.sampled_fps
    assert_language_model_metadata(processor, frames, metadata, their_kwargs, plan)


def assert_language_model_metadata(video_processor, frames, metadata, kwargs, plan):
    """Qwen2.5-VL's processor: second_per_grid_ts and the video's placeholders; Qwen3-VL's: the prompt of
    timestamped frame groups. Both processors built around the same video processor (no tokenizer needed)."""
    start, pad, end = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"
    qwen2_5 = object.__new__(Qwen2_5_VLProcessor)
    qwen2_5.video_processor, qwen2_5.video_token = video_processor, pad
    data, (text,) = qwen2_5._process_videos(frames, video_metadata=dict(metadata), return_metadata=True,
                                            return_tensors="pt", device="cpu", **kwargs)
    assert data["second_per_grid_ts"] == [plan.second_per_grid_t]
    assert text == pad * plan.num_tokens
    qwen3 = object.__new__(Qwen3VLProcessor)
    qwen3.video_processor, qwen3.video_token = video_processor, pad
    qwen3.vision_start_token, qwen3.vision_end_token = start, end
    _, (text,) = qwen3._process_videos(frames, video_metadata=dict(metadata), return_metadata=True,
                                       return_tensors="pt", device="cpu", **kwargs)
    assert text == "".join(timestamp_text(t) + start + pad * plan.tokens_per_group + end
                           for t in plan.group_timestamps)


@pytest.mark.parametrize("name, frames, options, their_kwargs", [
    # Qwen2's sample_frames with neither fps nor num_frames compares None with an int (TypeError).
    ("qwen2_5_published", 8, VideoOptions(sample_frames=True), {"do_sample_frames": True}),
    ("qwen2_5_published", 8, VideoOptions(num_frames=12), {"do_sample_frames": True, "num_frames": 12}),
    ("qwen3_published", 1, VideoOptions(), {}),  # smart_resize needs 2 frames
])
def test_what_transformers_refuses_is_invalid_input(name, frames, options, their_kwargs, tmp_path):
    spec, cfg, processor = checkpoint(tmp_path, name)
    data = make_clip("mp4_h264", frames=frames)
    with pytest.raises(InvalidInput):
        ours(data, cfg, options)
    metadata = {"total_num_frames": frames, "fps": 24.0, "frames_indices": list(range(frames))}
    with pytest.raises((ValueError, TypeError)):
        processor(decoded(data), video_metadata=metadata, return_tensors="pt", device="cpu", **their_kwargs)


def test_frames_given_as_images_match_transformers(family):
    """A list of frames (PNG images), not sampled: transformers given the PIL frames with do_sample_frames
    off and the caller's frame rate."""
    spec, cfg, processor = family
    frames = frame_images(5, height=60, width=100)
    probe, plan, pixel_values = ours(frames, cfg, VideoOptions(), frames_fps=3.0)
    images = [Image.open(io.BytesIO(f)) for f in frames]
    metadata = {"total_num_frames": 5, "fps": 3.0, "frames_indices": list(range(5))}
    reference = processor(images, video_metadata=metadata, do_sample_frames=False, return_metadata=True,
                          return_tensors="pt", device="cpu")
    assert_equal_to(reference, plan, pixel_values)
    assert_language_model_metadata(processor, images, metadata, {"do_sample_frames": False}, plan)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_settings_are_the_ones_transformers_loads(name, tmp_path):
    spec, cfg, processor = checkpoint(tmp_path, name)
    assert type(processor).__name__ == cfg.processor
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (cfg.pixels.min_pixels,
                                                                            cfg.pixels.max_pixels)
    assert (processor.patch_size, processor.temporal_patch_size, processor.merge_size) == (
        cfg.pixels.patch_size, cfg.pixels.temporal_patch_size, cfg.pixels.merge_size)
    assert tuple(processor.image_mean) == cfg.pixels.image_mean and tuple(processor.image_std) == cfg.pixels.image_std
    assert processor.do_sample_frames == cfg.do_sample_frames and processor.fps == cfg.fps
    assert (processor.min_frames, processor.max_frames, processor.max_video_tokens) == (
        cfg.min_frames, cfg.max_frames, cfg.max_video_tokens)
    assert bool(processor.cap_pixels_per_frame) == cfg.cap_pixels_per_frame


@pytest.mark.parametrize("model_type, files, expected", [
    # A Qwen3 checkpoint with an image file only: transformers infers Qwen2VLVideoProcessor from its type.
    ("qwen3_vl", {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16}},
     QWEN2_VIDEO),
    ("qwen3_vl", {"preprocessor_config.json": {"patch_size": 16}}, QWEN3_VIDEO),
    ("qwen3_vl_moe", {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessorPil",
                                                   "patch_size": 16}}, QWEN3_VIDEO),
    ("qwen2_vl", {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessorFast"}}, QWEN2_VIDEO),
    ("qwen2_5_vl", {"preprocessor_config.json": {}, "processor_config.json": {
        "video_processor": {"video_processor_type": "Qwen2VLVideoProcessor", "fps": 1.5}}}, QWEN2_VIDEO),
])
def test_processor_class_is_the_one_transformers_picks(model_type, files, expected, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    for filename, settings in files.items():
        write_checkpoint(tmp_path, settings, filename)
    spec = QWEN3 if model_type.startswith("qwen3") else QWEN2_5
    processor = AutoVideoProcessor.from_pretrained(tmp_path)
    cfg = VideoConfig.from_checkpoint(tmp_path, spec)
    assert type(processor).__name__ == cfg.processor == expected
    assert processor.fps == cfg.fps
