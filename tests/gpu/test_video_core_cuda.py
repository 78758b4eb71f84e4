"""Videos through the core on CUDA (core/videos.py: frame groups prepared on the model's device, on each CPU
thread's own stream): the pixel values the engine gets equal preprocess_group on CUDA bit for bit (which
tests/gpu/test_video_cuda.py holds to transformers' own with device="cuda"), and the rows fetched frame group
by frame group equal the whole video encoded in one call by the tower on the same device (float32, TF32 off).

    python -m pytest -q tests/gpu/test_video_core_cuda.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from encoder_service.api.service import build_core
from encoder_service.core import FetchItem
from encoder_service.core.types import VideoInput
from encoder_service.core.videos import GroupJob, VideoDecoder
from encoder_service.preprocessing import iter_frame_groups, plan_video, preprocess_group, probe_video
from encoder_service.preprocessing.video import VideoOptions
from tests.support.service import make_settings
from tests.support.video_cases import make_clip

CLIP = make_clip("mp4_h264", frames=9, width=160, height=112)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_groups_on_cuda_equal_the_whole_video(family, tiny_checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    core = build_core(make_settings(tiny_checkpoint(family), "--device", "cuda", "--dtype", "float32",
                                    "--no-cuda-graphs", "--video-window", "2", grpc=False))

    async def run():
        await core.start()
        try:
            (info,) = (await core.encode([], videos=[VideoInput(data=CLIP, sample_frames=False)])).videos
            items = [FetchItem(i, o) for i, o, _ in info.fetch_items(offset=0)]
            return (await core.fetch(items, 0, info.num_tokens, timeout_s=60)).rows
        finally:
            await core.stop()

    rows = asyncio.run(run())
    reader = core.videos.reader
    plan = plan_video(probe_video(CLIP, reader.limits), reader.cfg, VideoOptions(sample_frames=False), reader.limits)
    groups = [preprocess_group(f, plan, reader.cfg, device="cuda")
              for f in iter_frame_groups(CLIP, plan, reader.limits)]
    decoder = VideoDecoder(CLIP, plan, reader.limits, todo=range(plan.num_groups), keep=2)
    for g, expected in enumerate(groups):  # what the engine's prepare hands the GPU thread
        assert torch.equal(reader.prepare(GroupJob(decoder, plan, g), plan.group_grid), expected)
    whole = core.runner.encode([torch.cat(groups)], [plan.grid_thw])[0].cpu()
    torch.testing.assert_close(rows.float(), whole.float(), atol=1e-4, rtol=1e-4)
