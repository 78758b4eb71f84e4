"""The same greedy answer from a vLLM server that encodes images itself and from a language-only vLLM server
fed by our encoder (its connector, behind our proxy): one image, two images in both orders, a streamed answer,
a photo stored sideways with an EXIF orientation and an RGBA PNG (images as vLLM loads them: upright, alpha over
white); each lane: the connector over HTTP taking the rows through shared memory, and over gRPC without shared
memory. And one video (on the HTTP lane: its frame groups' rows through shared memory, its M-RoPE time step from
the proxy's second_per_grid_ts).

Both servers run the same checkpoint in float32; vLLM's vision tower and ours differ only by float32 rounding
(about 1e-6), so the tokens must be equal and the logprobs agree to float32 noise (LOGPROB_TOL).
"""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.support.engine_tier import require

require("vllm.entrypoints.openai.api_server", "scripts/tiers/vllm-e2e.sh")

from tests.support.images import image_bytes as png  # noqa: E402
from tests.support.vllm_e2e import (  # noqa: E402
    ANSWER_S,
    CALLER,
    Answer,
    answer,
    chat,
    streamed,
    streamed_answer,
    video_chat,
)

pytestmark = pytest.mark.timeout(1500)  # the first test waits for the servers (READY_S)

LANES = ["http", "grpc"]
# Measured: at most 4.6e-5 apart (the rows differ by ~1e-6; this language model's large weights amplify it);
# with other vision weights they are more than 1e-2 apart (test_e2e_failures.py).
LOGPROB_TOL = 5e-4
# Noise images (PNG, lossless) whose sides are multiples of 28, so neither side resizes them: vLLM preprocesses
# with transformers' torchvision processor, our encoder on the CPU with the PIL one (--preprocess pil), and the
# two differ after a resize (our --preprocess torchvision is vLLM's, bit for bit: the torchvision tier).
A, B, C = png(112, 84, 11), png(84, 140, 12), png(56, 112, 13)
# A video of 4 such frames (2 frame groups), lossless (PNG) in vLLM's JPEG-sequence form: vLLM's own video
# processor and our encoder see the same pixels. Its frame rate is vLLM's default for a sequence, 1 fps, so
# Qwen2.5-VL's second_per_grid_ts is 2 on both sides (the proxy sends ours).
FRAMES = [png(112, 84, 20 + k) for k in range(4)]


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


# A photo (tests/data/rocket.jpg, a 224x168 crop: neither side resizes it) as a phone stores a portrait: the
# pixels landscape, EXIF Orientation 6 (turn 90 degrees clockwise to view). vLLM's loader shows its processor the
# upright 168x224 picture (normalize_image: ImageOps.exif_transpose), and so does our encoder; SIDEWAYS is the
# same pixels without the tag, what the encoder used to see.
def _orientation(value: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif


PHOTO = Image.open(Path(__file__).parents[2] / "data" / "rocket.jpg").crop((208, 110, 432, 278))  # the rocket
ROTATED = encoded(PHOTO, "JPEG", quality=95, exif=_orientation(6))
SIDEWAYS = encoded(Image.open(io.BytesIO(ROTATED)).convert("RGB"), "PNG")
# An RGBA PNG whose alpha runs from transparent to opaque across it: vLLM's loader pastes it onto white, as the
# encoder composites it; NO_ALPHA is its colours with the alpha dropped.
_RGB = np.asarray(Image.open(io.BytesIO(png(112, 84, 14))))
_ALPHA = np.tile(np.linspace(0, 255, 112).astype(np.uint8), (84, 1))[..., None]
RGBA = encoded(Image.fromarray(np.concatenate([_RGB, _ALPHA], axis=-1), "RGBA"), "PNG")
NO_ALPHA = encoded(Image.fromarray(_RGB), "PNG")


def ask(url: str, body: dict, headers: dict | None = None) -> Answer:
    return answer(httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=ANSWER_S))


def assert_differ(a: Answer, b: Answer) -> None:
    """Answers further apart than assert_same allows: other tokens, or logprobs 10 tolerances apart (so rows in
    the wrong place could not pass as the same answer)."""
    if a.tokens == b.tokens:
        worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        assert worst > 10 * LOGPROB_TOL, (worst, a, b)


def assert_same(reference: Answer, got: Answer) -> None:
    assert got.tokens == reference.tokens, (got.tokens, reference.tokens)
    worst = max(abs(a - b) for a, b in zip(got.logprobs, reference.logprobs))
    assert len(got.logprobs) == len(reference.logprobs) and worst <= LOGPROB_TOL, (worst, got, reference)


@pytest.mark.parametrize("lane", LANES)
def test_one_image(stack, lane):
    reference = ask(stack.aggregated.url, chat([A]))
    assert_same(reference, ask(getattr(stack, lane).proxy_url, chat([A]), CALLER))


@pytest.mark.parametrize("lane", LANES)
def test_two_images_in_both_orders(stack, lane):
    proxy = getattr(stack, lane).proxy_url
    forward, backward = ask(stack.aggregated.url, chat([B, C])), ask(stack.aggregated.url, chat([C, B]))
    assert_differ(forward, backward)  # the order matters to the model: each image's rows must land in its place
    assert_same(forward, ask(proxy, chat([B, C]), CALLER))
    assert_same(backward, ask(proxy, chat([C, B]), CALLER))


@pytest.mark.parametrize("lane", LANES)
def test_streamed(stack, lane):
    reference = ask(stack.aggregated.url, chat([C], text="and this"))
    status, events = streamed(getattr(stack, lane).proxy_url, chat([C], text="and this", stream=True), CALLER)
    assert status == 200
    assert_same(reference, streamed_answer(events))


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("image, wrong", [(ROTATED, SIDEWAYS), (RGBA, NO_ALPHA)], ids=["exif_rotated_jpeg", "rgba_png"])
def test_images_as_vllm_loads_them(stack, lane, image, wrong):
    reference = ask(stack.aggregated.url, chat([image]))
    assert_differ(reference, ask(stack.aggregated.url, chat([wrong])))  # the model sees the difference
    assert_same(reference, ask(getattr(stack, lane).proxy_url, chat([image]), CALLER))


def test_one_video(stack):
    reference = ask(stack.aggregated.url, video_chat(FRAMES))
    assert_differ(reference, ask(stack.aggregated.url, video_chat(FRAMES[::-1])))  # the frames' order matters
    assert_same(reference, ask(stack.http.proxy_url, video_chat(FRAMES), CALLER))
