"""Issue 7: a real transformers Qwen-VL language model, prefilled chunk by chunk with rows fetched from the
running service (HTTP and gRPC), gives the logits of transformers' own forward with pixel_values.

Setup per family (Qwen2.5-VL, Qwen3-VL): a tiny random full VL checkpoint; the service (core + HTTP +
gRPC on loopback) serves its vision tower with our own implementation; transformers loads the full model
from the same directory for the reference and for the language model the integration drives.
Images are real PNG bytes; the reference pixel_values come from transformers' image processor loaded
from the checkpoint directory. Rows per chunk are counted on both sides of the wire: what the core
answered (server) and what the client decoded (its wire decoder checks the byte count against the header).
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_service.client import EncoderClient
from encoder_service.integrations import (
    VisionTokenIds,
    build_prompt,
    chunked_prefill,
    decode_step,
    expand_image_pads,
    mrope_position_ids,
)
from encoder_service.testing.tiny import build_tiny_checkpoint
from tests.support.reference import rel_err
from tests.support.service import RunningService, make_settings

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
REL_TOL = 1e-4

# (width, height) in pixels: 8 different sizes and aspect ratios (the tiny processor's limits give
# 4..64 merged tokens per image).
IMAGE_SIZES = [(64, 64), (150, 90), (45, 160), (220, 100), (77, 77), (180, 180), (40, 260), (130, 50)]
# prompt name -> (image indices into IMAGE_SIZES, chunk sizes); each chunk size splits some image.
PROMPTS = {
    "1img": ([2], (5, 8)),
    "3img": ([0, 1, 3], (7, 24)),
    "8img": (list(range(8)), (13, 64)),
}


# ---------------------------------------------------------------------------------------------------------
# checkpoint, images, reference


def _png(width: int, height: int, seed: int) -> bytes:
    """A real PNG: smooth gradients plus noise, so neighbouring patches differ."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


PNGS = [_png(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SIZES)]


def _text(n: int, vocab_low: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, vocab_low, (n,), generator=generator).tolist()


def _prompt_parts(infos, vocab_low: int, seed: int) -> list:
    """system text, then each image followed by some text (lengths vary), then a question."""
    g = torch.Generator().manual_seed(seed)
    parts = [_text(6, vocab_low, g)]
    for i, info in enumerate(infos):
        parts += [info, _text(1 + (5 * i) % 9, vocab_low, g)]
    return parts + [_text(4, vocab_low, g)]


# ---------------------------------------------------------------------------------------------------------
# the service: core + HTTP + gRPC on loopback (tests/support/service.py), with a fetch counter


class _CountingService:
    """The real service (tests/support/service.py: core + HTTP + gRPC on loopback) serving `checkpoint`;
    `fetch_log` records what the core answered to every fetch, whichever transport carried it."""

    def __init__(self, checkpoint: Path):
        self.running = RunningService(make_settings(checkpoint), checkpoint)
        self.fetch_log: list[tuple[int, int, int]] = []  # (start, end, rows answered) per core.fetch
        core = self.running.core
        fetch = core.fetch

        async def counted_fetch(items, start, end, *args, **kwargs):
            result = await fetch(items, start, end, *args, **kwargs)
            self.fetch_log.append((start, end, int(result.rows.shape[0])))
            return result

        core.fetch = counted_fetch  # both transports call core.fetch once per request

    def client(self, transport: str) -> EncoderClient:
        if transport == "http":
            return EncoderClient.http(self.running.url)
        return EncoderClient.grpc(self.running.grpc_address)

    def close(self) -> None:
        self.running.close()


class _FamilySetup:
    def __init__(self, family: str, root: Path):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText

        self.family = family
        self.checkpoint = build_tiny_checkpoint(family, root)
        self.model = AutoModelForImageTextToText.from_pretrained(self.checkpoint, dtype=torch.float32).eval()
        self.processor = AutoImageProcessor.from_pretrained(self.checkpoint)
        self.token_ids = VisionTokenIds.from_config(self.model.config)
        self.vocab_low = min(self.token_ids.image_token_id, self.token_ids.vision_start_token_id,
                             self.model.config.video_token_id)  # plain text ids stay below every special id
        self.service = _CountingService(self.checkpoint)
        self._reference: dict[str, torch.Tensor] = {}

    def reference_logits(self, name: str, prompt, image_indices: list[int]) -> torch.Tensor:
        """transformers' full-model forward with pixel_values from its own processor: [seq_len, vocab]."""
        if name not in self._reference:
            images = [Image.open(io.BytesIO(PNGS[i])) for i in image_indices]
            pixels = self.processor(images=images, return_tensors="pt")
            assert pixels["image_grid_thw"].tolist() == [list(g) for g in prompt.grid_thw]
            with torch.no_grad():
                out = self.model(input_ids=prompt.input_ids[None], pixel_values=pixels["pixel_values"],
                                 image_grid_thw=pixels["image_grid_thw"],
                                 mm_token_type_ids=prompt.mm_token_type_ids[None])
            self._reference[name] = out.logits[0]
        return self._reference[name]


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    s = _FamilySetup(request.param, tmp_path_factory.mktemp(f"prefill_{request.param}"))
    yield s
    s.service.close()


# ---------------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_chunked_prefill_matches_transformers(setup, transport, prompt_name):
    image_indices, chunk_sizes = PROMPTS[prompt_name]
    with setup.service.client(transport) as client:
        infos = client.encode([PNGS[i] for i in image_indices])
        prompt = build_prompt(_prompt_parts(infos, setup.vocab_low, seed=len(image_indices)), setup.token_ids)
        reference = setup.reference_logits(prompt_name, prompt, image_indices)
        image_mask = prompt.input_ids == setup.token_ids.image_token_id

        for chunk_size in chunk_sizes:
            # Some chunk boundary must cut through an image, or the test would not test range fetch.
            assert any(img.offset < b < img.end for img in prompt.images
                       for b in range(chunk_size, prompt.seq_len, chunk_size)), chunk_size

            client_rows: list[tuple[int, int, int]] = []  # (start, end, rows decoded) per client.fetch

            def counted_fetch(items, start, end):
                fetched = client.fetch(items, start, end)
                client_rows.append((start, end, int(fetched.rows.shape[0])))
                return fetched

            setup.service.fetch_log.clear()
            result = chunked_prefill(setup.model, prompt, counted_fetch, chunk_size)

            err = rel_err(result.logits, reference)
            print(f"{setup.family} {transport} {prompt_name} seq_len={prompt.seq_len} chunk={chunk_size}: "
                  f"rel err {err:.2e}")
            assert result.logits.shape == reference.shape
            assert err <= REL_TOL, err

            # Rows per chunk: exactly the chunk's placeholders, counted on both sides of the wire; chunks
            # without an image make no request.
            needed = [(s, min(s + chunk_size, prompt.seq_len),
                       int(image_mask[s:s + chunk_size].sum())) for s in range(0, prompt.seq_len, chunk_size)]
            with_images = [n for n in needed if n[2] > 0]
            assert client_rows == with_images
            assert setup.service.fetch_log == with_images
            assert [(c.start, c.end, c.rows_received) for c in result.chunks] == needed
            assert sum(n for _, _, n in client_rows) == sum(img.num_tokens for img in prompt.images)


def test_detects_wrong_integration(setup, monkeypatch):
    """The comparison is sensitive: 1-D positions instead of M-RoPE, or (Qwen3) deepstack left out, or rows
    shifted by one placeholder, each move the logits far past the tolerance."""
    from encoder_service.integrations import prefill as prefill_module

    image_indices, (chunk_size, _) = PROMPTS["3img"]
    with setup.service.client("http") as client:
        infos = client.encode([PNGS[i] for i in image_indices])
        prompt = build_prompt(_prompt_parts(infos, setup.vocab_low, seed=len(image_indices)), setup.token_ids)
        reference = setup.reference_logits("3img", prompt, image_indices)

        def shifted_fetch(items, start, end):  # each image's rows one position late
            fetched = client.fetch(items, start, end)
            return dataclasses.replace(fetched, rows=torch.roll(fetched.rows, 1, 0))

        errors = {"shifted rows": rel_err(chunked_prefill(setup.model, prompt, shifted_fetch, chunk_size).logits,
                                           reference)}
        with monkeypatch.context() as m:  # text-style positions 0..seq_len-1 on all three axes
            m.setattr(prefill_module, "mrope_position_ids",
                      lambda p, merge, **_: (torch.arange(p.seq_len).expand(3, -1).clone(), 0))
            errors["1-D positions"] = rel_err(chunked_prefill(setup.model, prompt, client.fetch, chunk_size).logits,
                                               reference)
        if setup.family == "qwen3_vl":
            def main_only(items, start, end):
                fetched = client.fetch(items, start, end)
                rows = fetched.rows.clone()
                rows[:, setup.model.config.text_config.hidden_size:] = 0  # keep [main], zero [ds_1..ds_3]
                return dataclasses.replace(fetched, rows=rows)

            errors["no deepstack"] = rel_err(chunked_prefill(setup.model, prompt, main_only, chunk_size).logits,
                                              reference)
    print(setup.family, errors)
    assert all(e > 20 * REL_TOL for e in errors.values()), errors


def test_decode_after_prefill_matches_transformers(setup):
    """Two text tokens decoded from the prefill's cache (positions cache_len + rope_delta) give the logits
    of transformers' full forward over prompt + those tokens."""
    image_indices, (chunk_size, _) = PROMPTS["3img"]
    with setup.service.client("grpc") as client:
        infos = client.encode([PNGS[i] for i in image_indices])
        prompt = build_prompt(_prompt_parts(infos, setup.vocab_low, seed=len(image_indices)), setup.token_ids)
        result = chunked_prefill(setup.model, prompt, client.fetch, chunk_size, all_logits=False)
    new_tokens = torch.tensor([3, 17])
    ours = decode_step(setup.model, result, new_tokens)
    pixels = setup.processor(images=[Image.open(io.BytesIO(PNGS[i])) for i in image_indices], return_tensors="pt")
    full_ids = torch.cat([prompt.input_ids, new_tokens])[None]
    with torch.no_grad():
        reference = setup.model(input_ids=full_ids, pixel_values=pixels["pixel_values"],
                                image_grid_thw=pixels["image_grid_thw"],
                                mm_token_type_ids=(full_ids == setup.token_ids.image_token_id).int()).logits[0]
    err = rel_err(torch.cat([result.logits, ours]), reference[-3:])
    print(f"{setup.family} decode after prefill: rel err {err:.2e}")
    assert err <= REL_TOL, err


def test_prefill_and_decode_pass_the_cache_by_the_name_transformers_keeps(setup):
    """No deprecation from transformers: from 5.24 the KV cache goes in as `cache` (`past_key_values` warns and
    goes in 5.40); 5.23 knows only `past_key_values` (integrations/prefill.py: cache_kwarg)."""
    import warnings

    image_indices, (chunk_size, _) = PROMPTS["1img"]
    with setup.service.client("http") as client, warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*(past_key_values|cache_params).*")
        infos = client.encode([PNGS[i] for i in image_indices])
        prompt = build_prompt(_prompt_parts(infos, setup.vocab_low, seed=1), setup.token_ids)
        result = chunked_prefill(setup.model, prompt, client.fetch, chunk_size, all_logits=False)
        decode_step(setup.model, result, torch.tensor([3]))
    assert result.past_key_values.get_seq_length() == prompt.seq_len + 1  # the decode step extended it in place


def test_mrope_equals_transformers_rope_index(setup):
    """mrope_position_ids == transformers' get_rope_index, for layouts without the service."""
    model = setup.model.model
    merge = setup.model.config.vision_config.spatial_merge_size
    # grids in patches (t, h, w): square, wide, tall, tiny, large; ids are arbitrary here.
    grids = [(1, 4, 4), (1, 2, 12), (1, 14, 6), (1, 2, 2), (1, 16, 10)]
    fake = [{"id": f"im{i}", "num_tokens": t * h * w // merge**2, "grid_thw": (t, h, w)}
            for i, (t, h, w) in enumerate(grids)]
    layouts = [
        [[1, 2, 3], fake[0], [4]],  # one image
        [fake[1], fake[2], [5, 6]],  # image first, two images back to back (only start/end between)
        [[7] * 9, fake[2], [8], fake[3], [9] * 3, fake[4], [10] * 2, fake[0], fake[1]],  # image last
    ]
    for parts in layouts:
        prompt = build_prompt(parts, setup.token_ids)
        ours, delta = mrope_position_ids(prompt, merge)
        theirs, their_delta = model.get_rope_index(prompt.input_ids[None], prompt.mm_token_type_ids[None],
                                                   image_grid_thw=torch.tensor(prompt.grid_thw))
        assert torch.equal(ours, theirs[:, 0]), parts
        assert delta == int(their_delta)


def test_expand_image_pads_equals_build_prompt(setup):
    """A prompt tokenized with one <|image_pad|> per image (the chat template) expands to build_prompt's."""
    t = setup.token_ids
    infos = [{"id": "a", "num_tokens": 6, "grid_thw": (1, 4, 6)}, {"id": "b", "num_tokens": 4, "grid_thw": (1, 4, 4)}]
    built = build_prompt([[1, 2], infos[0], [3], infos[1], [4]], t)
    templated = [1, 2, t.vision_start_token_id, t.image_token_id, t.vision_end_token_id, 3,
                 t.vision_start_token_id, t.image_token_id, t.vision_end_token_id, 4]
    expanded = expand_image_pads(templated, infos, t)
    assert torch.equal(built.input_ids, expanded.input_ids) and built.images == expanded.images
    assert built.fetch_items() == [("a", 3), ("b", 12)]  # 2 text, start, 6 a, end, 1 text, start
