"""Issue 21: a real transformers Qwen2.5-VL / Qwen3-VL language model, prefilled chunk by chunk with a video's
rows fetched from the running service frame group by frame group (HTTP and gRPC), gives the logits of
transformers' own forward on the same prompt with `pixel_values_videos`.

The prompt: text, an image, text, a video of 7 frames (odd: its last group repeats the last frame), text.
Qwen2.5-VL lays the video out as one run of `<|video_pad|>`s with M-RoPE time steps from
`second_per_grid_t`; Qwen3-VL as a `<t seconds>` text, vision start, the group's pads and vision end per
frame group (integrations/prompt.py). The reference's video pixel values are the service's own
preprocessing (torch ops on the CPU, bit-exact with transformers' video processors: tests/engines/
test_torchvision_video.py; transformers' video processors need torchvision, which this venv lacks), run
through transformers' own vision tower and language model. Chunk sizes put boundaries inside frame groups.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from PIL import Image

from encoder_service.client import EncoderClient, VideoSource
from encoder_service.integrations import VisionTokenIds, build_prompt, chunked_prefill, expand_image_pads
from encoder_service.integrations.mrope import mrope_position_ids
from encoder_service.preprocessing import (
    VideoConfig, VideoLimits, VideoOptions, iter_frame_groups, plan_video, preprocess_group, probe_video,
)  # fmt: skip
from encoder_service.testing.tiny import build_tiny_checkpoint
from tests.support.images import image_bytes
from tests.support.reference import rel_err
from tests.support.service import RunningService, make_settings
from tests.support.video_cases import make_clip

pytestmark = pytest.mark.timeout(300)

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
REL_TOL = 1e-4
# 7 frames at 8 fps: 4 groups 0.25 s apart; Qwen2.5-VL's time steps (tokens_per_second 4 in the tiny config)
# are 1 apart, within the spatial positions (mrope.py: where transformers 5.x and Qwen's own rule agree).
CLIP = make_clip("mp4_h264", frames=7, width=128, height=96, fps=8)
OPTIONS = {"sample_frames": False}  # every frame (7, odd), for both families
IMAGE = image_bytes(90, 60, 11)


def timestamp_tokens(text: str) -> list[int]:
    """A stand-in tokenizer for the timestamps' text (the tiny checkpoint has none): one id per character,
    below the special ids."""
    return [32 + ord(c) % 200 for c in text]


class Setup:
    def __init__(self, family: str, root):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText

        self.family = family
        self.checkpoint = build_tiny_checkpoint(family, root)
        self.model = AutoModelForImageTextToText.from_pretrained(self.checkpoint, dtype=torch.float32).eval()
        self.image_processor = AutoImageProcessor.from_pretrained(self.checkpoint)
        self.token_ids = VisionTokenIds.from_config(self.model.config)
        self.running = RunningService(make_settings(self.checkpoint, "--video-window", "2"), self.checkpoint)

    def client(self, transport: str) -> EncoderClient:
        if transport == "http":
            return EncoderClient.http(self.running.url, timeout=60)
        return EncoderClient.grpc(self.running.grpc_address, timeout=60)

    def video_pixels(self) -> tuple[torch.Tensor, list[int]]:
        loaded = self.running.core.loaded
        cfg, limits = VideoConfig.from_checkpoint(self.checkpoint, loaded.spec), VideoLimits()
        plan = plan_video(probe_video(CLIP, limits), cfg, VideoOptions(**OPTIONS), limits)
        groups = [preprocess_group(f, plan, cfg) for f in iter_frame_groups(CLIP, plan, limits)]
        return torch.cat(groups), list(plan.grid_thw)

    def reference_logits(self, prompt, video) -> torch.Tensor:
        """transformers' full-model forward on `prompt` with the image's and the video's pixel values."""
        image = self.image_processor(images=[Image.open(io.BytesIO(IMAGE))], return_tensors="pt")
        pixels, grid = self.video_pixels()
        assert grid == list(video.video_grid_thw)
        extra = {}
        if video.second_per_grid_t is not None:  # what Qwen2_5_VLProcessor returns: a float32 tensor
            extra["second_per_grid_ts"] = torch.tensor([video.second_per_grid_t])
        with torch.no_grad():
            return self.model(input_ids=prompt.input_ids[None], pixel_values=image["pixel_values"],
                              image_grid_thw=image["image_grid_thw"], pixel_values_videos=pixels,
                              video_grid_thw=torch.tensor([grid]), mm_token_type_ids=prompt.mm_token_type_ids[None],
                              **extra).logits[0]

    def close(self):
        self.running.close()


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    s = Setup(request.param, tmp_path_factory.mktemp(f"video_prefill_{request.param}"))
    yield s
    s.close()


def _prompt(setup, image, video):
    return build_prompt([[5, 6, 7], image, [8, 9], video, [10, 11, 12, 13]], setup.token_ids,
                        timestamp_tokens=timestamp_tokens)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_chunked_prefill_of_a_video_matches_transformers(setup, transport):
    with setup.client(transport) as client:
        (image,) = client.encode([IMAGE])
        (video,) = client.encode_videos([VideoSource(data=CLIP, **OPTIONS)])
        assert video.num_frames == 7 and video.num_groups == 4
        prompt = _prompt(setup, image, video)
        reference = setup.reference_logits(prompt, video)
        per = video.tokens_per_group
        starts = [at for _, at in prompt.fetch_items([s for s in prompt.slots if s.id == video.id])]

        def splits_a_group(chunk_size: int) -> bool:
            return any(at < b < at + per for at in starts for b in range(chunk_size, prompt.seq_len, chunk_size))

        # Chunk boundaries inside frame groups (or range fetch of groups would not be tested): a chunk of less
        # than a group, and one of more than two.
        for chunk_size in (per // 2 + 1, next(c for c in range(2 * per + 1, 4 * per) if splits_a_group(c))):
            assert splits_a_group(chunk_size)
            asked = []

            def fetch(items, start, end):
                asked.append([i for i, _ in items])
                return client.fetch(items, start, end)

            result = chunked_prefill(setup.model, prompt, fetch, chunk_size)
            err = rel_err(result.logits, reference)
            print(f"{setup.family} {transport} chunk {chunk_size}: seq_len {prompt.seq_len}, rel err {err:.2e}")
            assert result.logits.shape == reference.shape and err <= REL_TOL, err
            # Each chunk asked for the groups (and the image) it overlaps, no more; every row came once.
            assert sum(c.rows_received for c in result.chunks) == image.num_tokens + video.num_tokens
            assert all(len(ids) <= chunk_size // per + 2 for ids in asked)
            assert sorted({i for ids in asked for i in ids}) == sorted([image.id] + [video.group_id(g)
                                                                                    for g in range(4)])


def test_wrong_video_layouts_are_caught(setup):
    """The comparison is sensitive: the video's frame groups out of order, or (Qwen2.5-VL) M-RoPE without its
    time steps, or (Qwen3-VL) the timestamps left out, move the logits far past the tolerance."""
    with setup.client("http") as client:
        (image,) = client.encode([IMAGE])
        (video,) = client.encode_videos([VideoSource(data=CLIP, **OPTIONS)])
        prompt = _prompt(setup, image, video)
        reference = setup.reference_logits(prompt, video)
        errors = {}

        per = video.tokens_per_group
        whole = client.fetch(prompt.fetch_items([s for s in prompt.slots if s.id == video.id]), 0,
                             prompt.seq_len).rows  # [num_tokens, row_width], group after group

        def swapped(items, start, end):  # groups 0 and 1 trade rows
            fetched = client.fetch(items, start, end)
            rows, cursor = fetched.rows.clone(), 0
            for seg in fetched.segments:
                if seg.id.startswith(video.id):
                    g = {0: 1, 1: 0}.get(int(seg.id.rpartition("#")[2]), int(seg.id.rpartition("#")[2]))
                    rows[cursor:cursor + seg.num_rows] = whole[g * per + seg.row_start:g * per + seg.row_end]
                cursor += seg.num_rows
            return dataclasses.replace(fetched, rows=rows)

        errors["groups swapped"] = rel_err(chunked_prefill(setup.model, prompt, swapped, 9).logits, reference)
        if setup.family == "qwen2_5_vl":
            flat = dataclasses.replace(prompt, slots=tuple(
                dataclasses.replace(s, second_per_grid_t=0.1) if s.id == video.id else s for s in prompt.slots))
            errors["time steps of 0.1 s"] = rel_err(chunked_prefill(setup.model, flat, client.fetch, 9).logits,
                                                   reference)
        else:
            no_text = build_prompt([[5, 6, 7], image, [8, 9], video, [10, 11, 12, 13]], setup.token_ids,
                                   timestamp_tokens=lambda text: [])
            logits = chunked_prefill(setup.model, no_text, client.fetch, 9).logits
            errors["no timestamps"] = rel_err(logits[-4:], reference[-4:])
    print(setup.family, errors)
    assert all(e > 20 * REL_TOL for e in errors.values()), errors


def test_video_positions_and_template_expansion(setup):
    """mrope_position_ids == transformers' get_rope_index on prompts with videos (no service), and a templated
    prompt (one <|video_pad|> per video) expands to build_prompt's."""
    t = setup.token_ids
    merge = setup.model.config.vision_config.spatial_merge_size
    tokens_per_second = getattr(setup.model.config.vision_config, "tokens_per_second", None)
    qwen3 = setup.family == "qwen3_vl"
    videos = [video_answer(k, grid, second, merge, qwen3)
              for k, (grid, second) in enumerate((((3, 4, 6), 0.125), ((5, 4, 4), 1 / 12), ((1, 6, 4), 2.0)))]
    image = {"id": "im", "num_tokens": 4, "grid_thw": (1, 4, 4)}
    prompt = build_prompt([[1, 2], videos[0], [3], image, videos[1], [4] * 3, videos[2]], t,
                          timestamp_tokens=timestamp_tokens)
    ours, delta = mrope_position_ids(prompt, merge, tokens_per_second=tokens_per_second)
    extra = {} if qwen3 else {"second_per_grid_ts": torch.tensor([v["second_per_grid_t"] for v in videos])}
    theirs, their_delta = setup.model.model.get_rope_index(
        prompt.input_ids[None], prompt.mm_token_type_ids[None], image_grid_thw=torch.tensor([image["grid_thw"]]),
        video_grid_thw=torch.tensor([v["video_grid_thw"] for v in videos]), **extra)
    assert torch.equal(ours, theirs[:, 0]) and delta == int(their_delta)
    pad = [t.vision_start_token_id, t.video_token_id, t.vision_end_token_id]
    templated = [1, 2, *pad, 3, t.vision_start_token_id, t.image_token_id, t.vision_end_token_id, *pad, 4, 4, 4, *pad]
    expanded = expand_image_pads(templated, [image], t, videos=videos, timestamp_tokens=timestamp_tokens)
    assert torch.equal(expanded.input_ids, prompt.input_ids) and expanded.slots == prompt.slots


def video_answer(k: int, grid, second: float, merge: int, qwen3: bool) -> dict:
    """An encode answer's fields for a video of `grid` (its id and times made up)."""
    return {"id": f"v:u:{k}", "video_grid_thw": grid, "tokens_per_group": grid[1] * grid[2] // merge**2,
            "second_per_grid_t": None if qwen3 else second,
            "group_timestamps": [0.25 + g for g in range(grid[0])] if qwen3 else None}


def test_text_after_a_long_video_continues_past_its_time_range(setup):
    """Qwen2/2.5-VL: after a video whose temporal ids pass its spatial ones, our positions continue after the
    largest (Qwen's own rule, vLLM's and SGLang's); transformers 5.x continues at the spatial extent, inside
    the video's time range. Pinned here: when transformers changes, this test says so."""
    if setup.family == "qwen3_vl":
        pytest.skip("Qwen3-VL positions each frame group like an image: no temporal ids to pass")
    merge = setup.model.config.vision_config.spatial_merge_size
    video = video_answer(0, (4, 4, 4), 1.0, merge, False)  # time steps 4 apart (tokens_per_second 4)
    prompt = build_prompt([[1, 2], video, [3, 4]], setup.token_ids)
    ours, _ = mrope_position_ids(prompt, merge, tokens_per_second=4)
    theirs, _ = setup.model.model.get_rope_index(prompt.input_ids[None], prompt.mm_token_type_ids[None],
                                                 video_grid_thw=torch.tensor([video["video_grid_thw"]]),
                                                 second_per_grid_ts=torch.tensor([1.0]))
    slot = prompt.slots[0]
    assert torch.equal(ours[:, :slot.end], theirs[:, 0, :slot.end])  # the video itself: the same ids
    assert int(ours[0, slot.end - 1]) == 3 + 12 and int(ours[0, slot.end]) == 3 + 12 + 1  # after its largest
    assert int(theirs[0, 0, slot.end]) == 3 + 2  # transformers: p + max(h, w) / merge
