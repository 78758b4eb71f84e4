"""Videos through vLLM 0.33.0's own code (VllmInstance: tests/support/vllm_engine.py) against our real service.

The proxy (`encoder-service vllm-proxy`, the documented command) turns a chat request's video into a
video_embeds part; vLLM's own front end makes of it the prompt, placeholder and M-RoPE positions that its own
processor makes of the same frames (a JPEG sequence, `data:video/jpeg;base64,...`, which vLLM decodes without
a video library, so both sides see the same frames), and the connector puts all the video's frame groups'
rows into encoder_cache[uuid] (bit for bit our client's fetch of the groups), with vLLM never planning a local
encode. Videos and images mix in one request, also when vLLM re-hashes the identifiers.
"""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import pytest

from tests.support.engine_tier import require

require("vllm.config", "scripts/tiers/vllm.sh")  # not just any "vllm"

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from encoder_service.integrations.vllm import proxy  # noqa: E402
from tests.support.images import image_bytes as png  # noqa: E402
from tests.support.vllm_engine import FAMILIES, ProxyProcess, ec_config  # noqa: E402
from tests.support.vllm_stand_in import StandInVllm  # noqa: E402

pytestmark = pytest.mark.timeout(300)

OK = "length"  # finish reason of a request that ran (max_tokens reached)
CALLER = {"authorization": "Bearer caller-key"}
FPS = 3  # the sequences' frame rate: Qwen2.5-VL's second_per_grid_ts 2/3, Qwen3-VL's timestamps 1/6, 5/6, 4/3


def jpeg_frames(count: int, seed: int, height: int = 112, width: int = 168) -> list[bytes]:
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(count):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "JPEG")
        frames.append(out.getvalue())
    return frames


def video_part(frames: list[bytes]) -> dict:
    """vLLM's JPEG-sequence video: its frames' base64, comma-separated."""
    payload = ",".join(base64.b64encode(f).decode() for f in frames)
    return {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + payload}}


def chat(*parts: dict, **extra) -> dict:
    return {"model": "m", "max_completion_tokens": 2, **extra,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what happens"}]}]}


def mrope_positions(family: str, hf_config, request) -> torch.Tensor:
    """[3, prompt length]: the M-RoPE positions vLLM's model class computes for the request (the model's
    weights play no part: a stand-in `self` with its config)."""
    if family == "qwen3_vl":
        from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as Model

        return Model._get_mrope_input_positions(input_tokens=request.prompt_token_ids,
                                                mm_features=request.mm_features, config=hf_config)[0]
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Model

    model = SimpleNamespace(config=hf_config)
    model.iter_mm_grid_thw = Model.iter_mm_grid_thw.__get__(model)
    return Model.get_mrope_input_positions(model, request.prompt_token_ids, request.mm_features)[0]


@pytest.fixture(scope="module")
def fronts(encoders, tmp_path_factory):
    """{family: (proxy URL, stand-in vLLM)}: a proxy in front of each family's encoder."""
    made = {}
    try:
        for family in FAMILIES:
            vllm = StandInVllm()
            made[family] = (ProxyProcess(encoders[family].url, vllm.url,
                                         tmp_path_factory.mktemp("proxy") / f"{family}.log", "caller-key"), vllm)
        for p, _ in made.values():
            p.wait_ready(120)
        yield {family: (p.url, vllm) for family, (p, vllm) in made.items()}
    finally:
        for p, vllm in made.values():
            p.stop()
            vllm.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_video_as_vllm_computes_it(family, fronts, encoders, checkpoints, shm_dir, vllm_instance):
    url, stand_in = fronts[family]
    frames = jpeg_frames(5, seed=FAMILIES.index(family))  # 5 frames: 3 frame groups, the last padded
    body = chat(video_part(frames), media_io_kwargs={"video": {"fps": FPS}})
    answer = httpx.post(url + "/v1/chat/completions", json=body, headers=CALLER, timeout=120)
    assert answer.status_code == 200, answer.text
    forwarded = stand_in.bodies[-1]
    assert "media_io_kwargs" not in forwarded  # taken by the proxy: vLLM sees no video

    inst = vllm_instance(checkpoints[family], ec_config(encoders[family].url, shm_dir=str(shm_dir)),
                         trust_request_mm_kwargs=True)  # vLLM's own processing of `body` takes its frame rate
    own, ours = inst.request("own", body), inst.request("ours", forwarded)
    (own_video,), (our_video,) = own.mm_features, ours.mm_features
    assert own_video.data.get("pixel_values_videos") is not None and our_video.data.get("pixel_values_videos") is None
    assert ours.prompt_token_ids == own.prompt_token_ids  # Qwen3-VL: each group's "<t seconds>" text too
    assert (our_video.mm_position.offset, our_video.mm_position.length) == \
        (own_video.mm_position.offset, own_video.mm_position.length)
    own_mask, our_mask = own_video.mm_position.is_embed, our_video.mm_position.is_embed
    assert (own_mask is None and our_mask is None) or torch.equal(own_mask, our_mask)
    assert ours.get_num_encoder_embeds(0) == own.get_num_encoder_embeds(0)
    assert torch.equal(our_video.data["video_grid_thw"].data, own_video.data["video_grid_thw"].data)
    hf_config = inst.model_config.hf_config
    positions = mrope_positions(family, hf_config, ours)
    assert torch.equal(positions, mrope_positions(family, hf_config, own))
    if family == "qwen2_5_vl":
        seconds = our_video.data["second_per_grid_ts"].data
        assert seconds.dtype == torch.float32 and torch.equal(seconds, own_video.data["second_per_grid_ts"].data)
        del our_video.data["second_per_grid_ts"]  # without it vLLM steps time by 1 a group: other positions
        assert not torch.equal(mrope_positions(family, hf_config, ours), positions)
    else:
        assert our_video.data["timestamps"].data.tolist() == own_video.data["timestamps"].data

    with encoders[family].client() as c:
        (info,) = c.encode_videos([frames], frames_fps=FPS)  # the same frames and rate: the proxy's id
        want = c.fetch(info.fetch_items(0), 0, info.num_tokens).rows
        c.release([info.id])
    assert our_video.identifier == info.id and info.num_groups == 3
    assert inst.run([inst.request("ours", forwarded)]) == {"ours": OK}
    assert inst.local_encodes == {}
    assert torch.equal(inst.gathered[info.id], want)


CASES = [("qwen2_5_vl", dict(shm="on", transport="grpc")), ("qwen3_vl", dict(shm="off"))]


@pytest.mark.parametrize("family,how", CASES, ids=[f for f, _ in CASES])
def test_videos_and_images_in_one_request(family, how, encoders, checkpoints, shm_dir, vllm_instance):
    """Two videos and an image, in prompt order, in a request whose mm_processor_kwargs make vLLM re-hash the
    identifiers: ec_transfer_params maps them to our ids, and every item's rows reach the encoder cache."""
    encoder = encoders[family]
    url = "grpc://" + encoder.grpc if how.get("transport") == "grpc" else encoder.url
    inst = vllm_instance(checkpoints[family], ec_config(url, shm=how["shm"], shm_dir=str(shm_dir)),
                         trust_request_mm_kwargs=True)
    first, second, image = jpeg_frames(5, seed=10), jpeg_frames(4, seed=11, height=84, width=140), png(112, 84, 12)
    with encoder.client() as c:
        (a, b), (i,) = c.encode_videos([first, second], frames_fps=FPS), c.encode([image])
        want = {a.id: c.fetch(a.fetch_items(0), 0, a.num_tokens).rows,
                b.id: c.fetch(b.fetch_items(0), 0, b.num_tokens).rows,
                i.id: c.fetch([(i.id, 0)], 0, i.num_tokens).rows}
    body = chat(video_part(first), {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                video_part(second), mm_processor_kwargs={"max_pixels": 1 << 20})
    request = inst.request("mixed", proxy.rewrite(body, [a, i, b], family))
    assert [f.modality for f in request.mm_features] == ["video", "image", "video"]
    identifiers = [f.identifier for f in request.mm_features]
    assert not {a.id, b.id, i.id} & set(identifiers)  # re-hashed: the ids come in ec_transfer_params
    assert inst.run([request]) == {"mixed": OK} and inst.local_encodes == {}
    for identifier, ours in zip(identifiers, (a, i, b)):
        assert torch.equal(inst.gathered[identifier], want[ours.id]), ours.id
    assert inst.connector.table.counters["fetches"] == 3
