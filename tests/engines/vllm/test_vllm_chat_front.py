"""The proxy (`encoder-service vllm-proxy`, the documented command line, run from the main venv) between a
client and a stand-in vLLM HTTP server, with the request it forwards fed through vLLM's own chat front end,
Scheduler and our connector: the image_embeds parts are accepted, each with as many placeholder tokens as
our encode answered, and the rows reach encoder_cache. Streamed answers pass through chunk by chunk.
"""

from __future__ import annotations

import json
import time

import blake3
import pytest

from tests.support.engine_tier import require

require("vllm.config", "scripts/tiers/vllm.sh")  # not just any "vllm"

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.support.images import data_url  # noqa: E402
from tests.support.images import image_bytes as png  # noqa: E402
from tests.support.vllm_engine import ProxyProcess, ec_config  # noqa: E402
from tests.support.vllm_stand_in import CHUNKS, StandInVllm  # noqa: E402

pytestmark = pytest.mark.timeout(300)
GAP_S = 0.4  # between the stand-in's streamed events
CALLER = {"authorization": "Bearer caller-key"}  # the proxy's --api-key, as its callers send it


@pytest.fixture(scope="module")
def front(encoders, tmp_path_factory):
    """(proxy URL, stand-in vLLM) with the proxy in front of the Qwen2.5-VL encoder."""
    vllm = StandInVllm(gap_s=GAP_S)
    proxy = ProxyProcess(encoders["qwen2_5_vl"].url, vllm.url, tmp_path_factory.mktemp("proxy") / "proxy.log",
                         api_key="caller-key")
    try:
        proxy.wait_ready(120)
        yield proxy.url, vllm
    finally:
        proxy.stop()
        vllm.shutdown()



def chat_body(images: list[bytes], text: str, **extra) -> dict:
    return {"model": "m", "max_completion_tokens": 2, **extra, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(images[0])}},
                                     {"type": "text", "text": text}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images[1:]]
         + [{"type": "text", "text": text}]}]}


def test_forwarded_request_goes_through_vllms_front_end(front, encoders, checkpoints, shm_dir, vllm_instance):
    url, vllm = front
    encoder = encoders["qwen2_5_vl"]
    images = [png(224, 168, 4001), png(84, 140, 4002), png(56, 112, 4003)]
    answer = httpx.post(url + "/v1/chat/completions", json=chat_body(images, "what is it"), headers=CALLER,
                        timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ok"
    forwarded = vllm.bodies[-1]
    with encoder.client() as c:
        infos = c.encode(images)  # the same bytes: the same ids (and one more pin each, released below)
        c.release([i.id for i in infos])
    parts = [p for m in forwarded["messages"] if isinstance(m["content"], list) for p in m["content"]
             if p["type"] != "text"]
    assert parts == [{"type": "image_embeds", "image_embeds": {"image_grid_thw": list(i.grid_thw)}, "uuid": i.id}
                     for i in infos]
    assert forwarded["ec_transfer_params"] == {"encoder_service": {"ids": [i.id for i in infos]}}

    inst = vllm_instance(checkpoints["qwen2_5_vl"], ec_config(encoder.url, shm_dir=str(shm_dir)))
    request = inst.request("fwd", forwarded)  # vLLM's ChatCompletionRequest, OnlineRenderer, InputProcessor
    assert [f.identifier for f in request.mm_features] == [i.id for i in infos]
    assert [request.get_num_encoder_embeds(k) for k in range(len(infos))] == [i.num_tokens for i in infos]
    image_pad = 255  # the tiny tokenizer's <|image_pad|>
    assert request.prompt_token_ids.count(image_pad) == sum(i.num_tokens for i in infos)
    assert inst.run([request]) == {"fwd": "length"} and inst.local_encodes == {}
    with encoder.client() as c:
        for i in infos:
            assert torch.equal(inst.gathered[i.id], c.fetch([(i.id, 0)], 0, i.num_tokens).rows)


def test_streamed_answer_passes_through_chunk_by_chunk(front):
    url, vllm = front
    arrivals, data = [], b""
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, headers=CALLER,
                      json=chat_body([png(84, 84, 4101)], "stream it", stream=True)) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.iter_raw():
            arrivals.append(time.monotonic() - start)
            data += chunk
    events = [e for e in data.decode().split("\n\n") if e]
    assert len(events) == CHUNKS + 1 and events[-1] == "data: [DONE]"
    assert [json.loads(e.removeprefix("data: "))["choices"][0]["delta"]["content"] for e in events[:-1]] == \
        [str(k) for k in range(CHUNKS)]
    # the first event arrives while vLLM is still sending the rest, not once the answer is complete
    assert len(arrivals) >= CHUNKS and arrivals[-1] - arrivals[0] >= (CHUNKS - 1) * GAP_S * 0.8
    assert vllm.bodies[-1]["stream"] is True


def test_errors(front, encoders):
    url, vllm = front
    sent = len(vllm.bodies)
    bad = httpx.post(url + "/v1/chat/completions", json=chat_body([b"not an image"], "x"), headers=CALLER,
                     timeout=60)
    assert bad.status_code == 400 and "encoder service" in bad.json()["error"]["message"]
    assert len(vllm.bodies) == sent  # nothing forwarded
    image = png(140, 84, 4201)
    refused = httpx.post(url + "/v1/chat/completions", json=chat_body([image], "refuse"), headers=CALLER,
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "refused"
    with encoders["qwen2_5_vl"].client() as c:  # the proxy's encode pinned the image; it released that pin itself
        assert c.release([blake3.blake3(image).hexdigest(length=16)]) == 0  # our content id
    assert httpx.get(url + "/v1/models", headers=CALLER, timeout=10).json() == {"data": [{"id": "m"}]}
    assert httpx.post(url + "/v1/chat/completions", json=chat_body([image], "x"), timeout=60).status_code == 401
