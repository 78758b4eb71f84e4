"""The tower's own output for an image, run alone outside the service: what every embedding the service
returns must equal (float32 on the CPU)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=None)
def _reference_model(checkpoint: str):
    from encoder_service.models.loader import load_model
    from encoder_service.preprocessing import PreprocessConfig

    loaded = load_model(checkpoint, device="cpu", dtype="float32")
    return loaded, PreprocessConfig.from_checkpoint(loaded.checkpoint_dir, loaded.spec)


def reference_rows(checkpoint: Path, data: bytes, preprocess: str = "pil") -> torch.Tensor:
    """[num_tokens, row_width] float32: the tower of `checkpoint` on `data` preprocessed by the `preprocess`
    backend on the CPU, alone."""
    from encoder_service.preprocessing import ImageLimits, make_backend

    loaded, cfg = _reference_model(str(checkpoint))
    backend = make_backend(preprocess, cfg, ImageLimits(max_image_bytes=1 << 24, max_pixels=1 << 26), "cpu")
    pre = backend.preprocess(data)
    grid = tuple(int(x) for x in pre.grid_thw)
    with torch.inference_mode():
        return loaded.tower(pre.pixel_values.to(loaded.dtype), loaded.tower.metadata([grid])).float()


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=1e-4)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of `a` from the reference `b`, over b's largest magnitude (logits: one scale)."""
    return float((a - b).abs().max() / b.abs().max())


def reference_video_rows(checkpoint: Path, video, options=None) -> torch.Tensor:
    """[num_tokens, row_width] float32: the tower of `checkpoint` on the whole video (a file's bytes, or its
    frames) in one call, grid (t, h, w), its frame groups preprocessed as the service does (torch ops on the
    CPU, bit-exact with transformers' video processor: tests/engines/test_torchvision_video.py)."""
    from encoder_service.preprocessing import (
        VideoConfig, VideoLimits, VideoOptions, iter_frame_groups, plan_video, preprocess_group, probe_video,
    )  # fmt: skip

    loaded, _ = _reference_model(str(checkpoint))
    cfg, limits = VideoConfig.from_checkpoint(loaded.checkpoint_dir, loaded.spec), VideoLimits()
    options = dict(options or {})
    frames_fps = options.pop("frames_fps", None)
    plan = plan_video(probe_video(video, limits, frames_fps=frames_fps), cfg, VideoOptions(**options), limits)
    pixel_values = torch.cat([preprocess_group(frames, plan, cfg) for frames in iter_frame_groups(video, plan, limits)])
    with torch.inference_mode():
        return loaded.tower(pixel_values.to(loaded.dtype), loaded.tower.metadata([plan.grid_thw])).float()
