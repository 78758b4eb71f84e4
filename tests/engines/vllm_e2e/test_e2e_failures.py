"""What a client sees when an image can't be had, measured against the real servers (docs/vllm.md, "When an
image fails", says the same): every answer comes within ANSWER_S (no hang), and the reason is ours.

  - through the proxy, a bad image or an encoder that is down is the proxy's own 4xx / 5xx with our error's
    kind and message: vLLM is not called (an encoder that is down is retried first, for the proxy's
    --timeout-s: client/retry.py);
  - a request sent to the language-only vLLM directly whose image id the encoder doesn't have (unknown,
    evicted) or can't serve (down, after the connector's fetch_timeout_s of retries) is failed by our
    connector: vLLM's front end answers it with a bare HTTP 500 "Internal server error" (streamed: a 200
    whose stream carries that error event), and vLLM's log has our reason.

Last, the encoder comes back with other vision weights and the language-only instance's answer changes: it
answers from our rows, not from a vision tower of its own. The tests run in this order (the last two stop
the encoder).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.engine_tier import require

require("vllm.entrypoints.openai.api_server", "scripts/tiers/vllm-e2e.sh")

from encoder_service import errors  # noqa: E402
from tests.support.images import image_bytes as png  # noqa: E402
from tests.support.images import truncated_jpeg  # noqa: E402
from tests.support.vllm_e2e import ANSWER_S, CALLER, DOWN_TIMEOUT_S, answer, chat, embeds_chat, streamed  # noqa: E402

pytestmark = pytest.mark.timeout(1500)  # the first test waits for the servers (READY_S)

# vLLM 0.32's answer to a request its engine failed (finish reason "error"), as measured.
VLLM_FAILED = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                         "code": 500}}


def post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=ANSWER_S)


def encoded(stack, image: bytes):
    """Our id and grid of `image`, encoded (and its pin released) by a client of the encoder."""
    with stack.encoder.client() as client:
        info = client.encode([image], wait=True)[0]
        client.release([info.id])
    return info


def assert_failed_by_vllm(stack, item_id: str, grid, why: str) -> None:
    """A request naming `item_id`, straight to the language-only vLLM: the bare 500 (and the streamed error
    event), our reason in vLLM's log."""
    vllm = stack.http.vllm
    r = post(vllm.url, embeds_chat([(item_id, grid)]))
    assert (r.status_code, r.json()) == (500, VLLM_FAILED)
    status, events = streamed(vllm.url, embeds_chat([(item_id, grid)], stream=True))
    assert status == 200 and events[-2:] == [VLLM_FAILED, "[DONE]"], events
    failing = [line for line in vllm.log_path.read_text(errors="replace").splitlines()
               if "failing request" in line and item_id in line]
    assert failing and all(why in line for line in failing), vllm.log_tail()


@pytest.mark.parametrize("lane", ["http", "grpc"])
def test_bad_image_is_the_proxys_400(stack, lane):
    proxy = getattr(stack, lane).proxy_url
    for image, why in [(truncated_jpeg(21), "decode"), (b"not an image", "not an image")]:
        r = post(proxy, chat([png(56, 56, 22), image]), CALLER)
        error = r.json()["error"]
        assert (r.status_code, error["type"]) == (400, "invalid_input"), error
        assert error["message"].startswith("encoder service: image 1: ") and why in error["message"], error


def test_unknown_id(stack):
    assert_failed_by_vllm(stack, "0" * 32, (1, 6, 8), "is not at the encoder service")


def test_evicted_id(stack):
    info = encoded(stack, png(112, 84, 31))
    with stack.encoder.client() as client:  # some 120 other images through a cache that holds about 80
        for k in range(8):
            batch = client.encode([png(112, 84, 1000 + 16 * k + j) for j in range(16)], wait=True)
            client.release([i.id for i in batch])
        with pytest.raises(errors.NotFound):
            client.fetch([(info.id, 0)], 0, info.num_tokens)
    assert_failed_by_vllm(stack, info.id, info.grid_thw, "is not at the encoder service")


def test_encoder_down(stack):
    """Both proxies and the language-only vLLM, at once (each retries the encoder for its timeout first: the
    proxies asked here are the lanes' quick ones, the same but for their --timeout-s)."""
    info = encoded(stack, png(112, 84, 41))  # known to the encoder, never sent to vLLM
    stack.restart_encoder(None)
    start = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        proxied = [pool.submit(post, lane.quick_proxy_url, chat([png(56, 56, 42)]), CALLER)
                   for lane in (stack.http, stack.grpc)]
        direct = pool.submit(assert_failed_by_vllm, stack, info.id, info.grid_thw, "failed")
        for answered in proxied:
            r = answered.result()
            error = r.json()["error"]
            assert (r.status_code, error["type"]) == (503, "unavailable"), error
            assert "encoder service" in error["message"], error
        direct.result()
    assert time.monotonic() - start < DOWN_TIMEOUT_S + 30


def test_other_vision_weights_change_the_answer(stack):
    """The language-only instance's answer follows the encoder: with other vision weights behind the same URL it
    differs from the aggregated server's, where with ours it is the same (test_e2e_answers.py)."""
    stack.restart_encoder(stack.other)
    image = png(112, 84, 51)
    reference = answer(post(stack.aggregated.url, chat([image])))
    for lane in (stack.http, stack.grpc):
        got = answer(post(lane.proxy_url, chat([image]), CALLER))  # the gRPC channel reconnects in a retry
        assert got.tokens != reference.tokens
        assert max(abs(a - b) for a, b in zip(got.logprobs, reference.logprobs)) > 1e-2
