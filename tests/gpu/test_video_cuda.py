"""Video frame groups prepared on CUDA (preprocessing/video.py: preprocess_group with device="cuda") equal
transformers' video processors run with device="cuda" on the same decoded frames, bit for bit (the resize
goes through float32 there, torch_ops.resize; the CPU comparison is tests/engines/test_torchvision_video.py).

Needs torchvision (transformers' video processors import it) and PyAV:
    python -m pytest -q tests/gpu/test_video_cuda.py
"""

from __future__ import annotations

import io
import json

import av
import numpy as np
import pytest
import torch

pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")

from transformers import AutoVideoProcessor

from encoder_service.preprocessing import (
    VideoConfig,
    VideoLimits,
    VideoOptions,
    iter_frame_groups,
    plan_video,
    preprocess_group,
    probe_video,
)
from tests.support.preprocess_cases import HUB_CONFIGS, QWEN2_5, QWEN3, write_checkpoint
from tests.support.video_cases import make_clip

QWEN3_VIDEO_FILE = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                    "video_processor_type": "Qwen3VLVideoProcessor"}
FAMILIES = {  # published layouts: Qwen2.5-VL's videos use its image file, Qwen3-VL has a video file
    "qwen2_5": (QWEN2_5, "qwen2_5_vl", "preprocessor_config.json", HUB_CONFIGS["qwen2_5"][1]),
    "qwen3": (QWEN3, "qwen3_vl", "video_preprocessor_config.json", QWEN3_VIDEO_FILE),
}


@pytest.mark.parametrize("options", [VideoOptions(), VideoOptions(fps=4), VideoOptions(max_pixels=200_000)],
                         ids=["default", "fps_4", "max_pixels"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_frame_groups_on_cuda_equal_transformers(name, options, tmp_path):
    spec, model_type, filename, settings = FAMILIES[name]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    write_checkpoint(tmp_path, settings, filename)
    cfg, processor = VideoConfig.from_checkpoint(tmp_path, spec), AutoVideoProcessor.from_pretrained(tmp_path)
    limits = VideoLimits()
    data = make_clip("mp4_h264", frames=21, width=320, height=180, fps=12)
    probe = probe_video(data, limits)
    plan = plan_video(probe, cfg, options, limits)
    ours = torch.cat([preprocess_group(frames, plan, cfg, device="cuda")
                      for frames in iter_frame_groups(data, plan, limits)])

    with av.open(io.BytesIO(data)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    metadata = {"total_num_frames": probe.total_frames, "fps": probe.fps, "frames_indices": list(range(len(frames)))}
    kwargs = {"do_sample_frames": True, "fps": options.fps} if options.fps else {}
    if options.max_pixels:
        kwargs["size"] = {"shortest_edge": cfg.pixels.min_pixels, "longest_edge": options.max_pixels}
    reference = processor(frames, video_metadata=metadata, return_tensors="pt", device="cuda", **kwargs)
    assert tuple(reference["video_grid_thw"][0].tolist()) == plan.grid_thw
    theirs = reference["pixel_values_videos"]
    assert ours.device.type == theirs.device.type == "cuda" and ours.shape == theirs.shape
    diff = (ours - theirs).abs()
    assert torch.equal(ours, theirs), f"max |diff| {diff.max().item()}, {(diff > 0).float().mean().item():.2%} differ"
