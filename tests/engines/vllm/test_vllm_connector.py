"""EncoderServiceConnector inside vLLM 0.33.0's own code (VllmInstance: tests/support/vllm_engine.py), against
our real service.

vLLM's factory loads the connector from the documented --ec-transfer-config in both roles; a chat request
with metadata-only image_embeds parts (the proxy's rewrite) goes through vLLM's front end and Scheduler; the
worker-side wrapper fills encoder_cache[uuid], which must equal our client's fetch of that id bit for bit,
with vLLM never planning a local encode. Bad items (unknown, evicted, wrong grid, wrong width, encoder down,
an identifier vLLM re-hashed without our ids) fail their request only, and nothing reaches encoder_cache.
"""

from __future__ import annotations

from collections import namedtuple

import pytest

from tests.support.engine_tier import require

require("vllm.config", "scripts/tiers/vllm.sh")  # not just any "vllm"

import torch  # noqa: E402

from encoder_service import errors  # noqa: E402
from encoder_service.integrations.vllm import proxy  # noqa: E402
from tests.support.images import image_bytes as png  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.vllm_engine import ec_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

OK = "length"  # finish reason of a request that ran (max_tokens reached)
Encoded = namedtuple("Encoded", "id grid_thw")  # what the rewrite reads of an encode answer


def chat(infos, text: str = "what is it", **extra) -> dict:
    """The chat body the proxy forwards for these encoded images (image parts first, then the text)."""
    body = {"model": "m", "max_completion_tokens": 2, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}} for _ in infos),
        {"type": "text", "text": text}]}], **extra}
    return proxy.rewrite(body, infos)


def fetched(encoder, info) -> torch.Tensor:
    with encoder.client() as c:
        return c.fetch([(info.id, 0)], 0, info.num_tokens).rows


def test_factory_loads_the_documented_connector(encoders, checkpoints, vllm_instance):
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from encoder_service.integrations.vllm.connector import EncoderServiceConnector

    config = ec_config(encoders["qwen2_5_vl"].url)
    model = ModelConfig(model=str(checkpoints["qwen2_5_vl"]), dtype="float32", max_model_len=1024, enforce_eager=True)
    vllm_config = VllmConfig(model_config=model, ec_transfer_config=ECTransferConfig(**config))
    assert ECConnectorFactory.get_connector_class(vllm_config.ec_transfer_config) is EncoderServiceConnector
    mm = vllm_config.model_config.multimodal_config
    assert mm.enable_mm_embeds and mm.allow_missing_mm_embeddings  # what ec_consumer turns on
    for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
        c = ECConnectorFactory.create_connector(vllm_config, role)
        assert isinstance(c, EncoderServiceConnector) and c.is_consumer and c.row_width == 48
        assert (c.table is not None) == (role == ECConnectorRole.SCHEDULER)
        c.shutdown()
    bad = dict(config, ec_role="ec_producer")
    with pytest.raises(ValueError, match="ec_consumer"):
        ECConnectorFactory.create_connector(VllmConfig(model_config=model, ec_transfer_config=ECTransferConfig(**bad)),
                                            ECConnectorRole.SCHEDULER)
    bad = dict(config, ec_connector_extra_config={"url": "ftp://x"})
    with pytest.raises(ValueError, match="http://host:port"):
        ECConnectorFactory.create_connector(VllmConfig(model_config=model, ec_transfer_config=ECTransferConfig(**bad)),
                                            ECConnectorRole.SCHEDULER)


CASES = [  # family, how the connector fetches, images per request (a repeated image is one item twice)
    ("qwen2_5_vl", dict(shm="auto"), 1),
    ("qwen2_5_vl", dict(shm="off", transport="grpc"), 3),
    ("qwen3_vl", dict(shm="off"), 1),
    ("qwen3_vl", dict(shm="on", transport="grpc"), 3),
]


@pytest.mark.parametrize("family,how,n", CASES, ids=[f"{f}-{h.get('transport', 'http')}-shm_{h['shm']}-{n}img"
                                                      for f, h, n in CASES])
def test_rows_reach_the_encoder_cache(encoders, checkpoints, shm_dir, vllm_instance, family, how, n):
    encoder = encoders[family]
    url = "grpc://" + encoder.grpc if how.get("transport") == "grpc" else encoder.url
    inst = vllm_instance(checkpoints[family], ec_config(url, shm=how["shm"], shm_dir=str(shm_dir)))
    seed = 1000 + 10 * CASES.index((family, how, n))
    images = [png(224, 168, seed), png(84, 140, seed + 1), png(224, 168, seed)][:n]
    with encoder.client() as c:
        infos = c.encode(images)
    requests = [inst.request("r0", chat(infos)), inst.request("r1", chat(infos[:1], "again"))]
    features = requests[0].mm_features
    assert [f.identifier for f in features] == [i.id for i in infos]  # the uuid is the identifier
    assert [requests[0].get_num_encoder_embeds(k) for k in range(n)] == [i.num_tokens for i in infos]
    assert requests[0].ec_transfer_params == {"encoder_service": {"ids": [i.id for i in infos]}}

    assert inst.run(requests) == {"r0": OK, "r1": OK}
    assert inst.local_encodes == {}
    width = 48 if family == "qwen2_5_vl" else 48 * 4  # Qwen3-VL rows: [main | deepstack_1..3]
    assert inst.connector.table.fetcher.mode == ("shm" if how["shm"] != "off" else how.get("transport", "http"))
    for info in infos:
        rows = inst.gathered[info.id]
        assert rows.shape == (info.num_tokens, width) and rows.dtype == torch.float32 and rows.device.type == "cpu"
        assert torch.equal(rows, fetched(encoder, info))
    counters = inst.connector.table.counters
    assert counters["fetches"] == len({i.id for i in infos}) and counters["failed_requests"] == 0


def test_bad_items_fail_only_their_request(encoders, checkpoints, shm_dir, vllm_instance):
    encoder = encoders["qwen2_5_vl"]
    inst = vllm_instance(checkpoints["qwen2_5_vl"], ec_config(encoder.url, shm="off", shm_dir=str(shm_dir),
                                                               fetch_timeout_s=10))
    with encoder.client() as c:
        good, victim, other = c.encode([png(224, 168, 2001), png(224, 168, 2002), png(84, 140, 2003)], wait=True)
        assert c.release([victim.id]) == 1
        for k in range(12):  # push the victim out of the encoder's 1 MiB cache
            fill = c.encode([png(224, 224, 3000 + 8 * k + j) for j in range(8)], wait=True)
            c.release([i.id for i in fill])
        with pytest.raises(errors.NotFound):
            c.fetch([(victim.id, 0)], 0, victim.num_tokens)
    wrong_grid = chat([other])
    wrong_grid["messages"][0]["content"][0]["image_embeds"]["image_grid_thw"] = [1, 8, 8]  # 16 tokens, not other's
    requests = [inst.request("good", chat([good])), inst.request("unknown", chat([Encoded("f" * 32, good.grid_thw)])),
                inst.request("evicted", chat([victim])), inst.request("grid", wrong_grid)]
    assert inst.run(requests) == {"good": OK, "unknown": "error", "evicted": "error", "grid": "error"}
    assert inst.local_encodes == {}
    assert set(inst.gathered) == {good.id} and torch.equal(inst.gathered[good.id], fetched(encoder, good))
    assert ("f" * 32 not in inst.encoder_cache and victim.id not in inst.encoder_cache
            and other.id not in inst.encoder_cache)
    assert inst.connector.table.counters["failed_requests"] == 3


def test_wrong_width_and_encoder_down_fail_the_request(encoders, checkpoints, shm_dir, vllm_instance):
    with encoders["qwen2_5_vl"].client() as c:
        (info,) = c.encode([png(224, 168, 2101)])
    # a Qwen3-VL model (rows 192 wide) pointed at the Qwen2.5-VL encoder (48 wide)
    wrong = vllm_instance(checkpoints["qwen3_vl"], ec_config(encoders["qwen2_5_vl"].url, shm="off",
                                                              shm_dir=str(shm_dir)))
    body = chat([info])
    body["messages"][0]["content"][0]["image_embeds"]["image_grid_thw"] = [1, 12, 16]  # 48 tokens either way
    assert wrong.run([wrong.request("w", body)]) == {"w": "error"}
    assert wrong.local_encodes == {} and wrong.encoder_cache == {}
    down = vllm_instance(checkpoints["qwen2_5_vl"], ec_config(f"http://127.0.0.1:{free_port()}", shm="off",
                                                             shm_dir=str(shm_dir), fetch_timeout_s=5))
    assert down.run([down.request("d", chat([info]))]) == {"d": "error"}
    assert down.local_encodes == {} and down.encoder_cache == {}


def test_rehashed_identifier_maps_through_ec_transfer_params(encoders, checkpoints, shm_dir, vllm_instance):
    encoder = encoders["qwen3_vl"]
    inst = vllm_instance(checkpoints["qwen3_vl"], ec_config(encoder.url, shm="on", shm_dir=str(shm_dir)),
                         trust_request_mm_kwargs=True)
    with encoder.client() as c:
        a, b = c.encode([png(224, 168, 2201), png(84, 140, 2202)])
    kwargs = {"mm_processor_kwargs": {"max_pixels": 1 << 20}}  # per request: vLLM hashes uuid + kwargs
    mapped, unmapped = inst.request("mapped", chat([a, b], **kwargs)), inst.request("unmapped", chat([a], **kwargs))
    unmapped.ec_transfer_params = None
    ids = [f.identifier for f in mapped.mm_features]
    assert ids[0] not in (a.id, b.id) and len(ids[0]) == 64  # blake3 hex of uuid + kwargs
    assert inst.run([mapped, unmapped]) == {"mapped": OK, "unmapped": "error"}
    assert inst.local_encodes == {}
    assert torch.equal(inst.gathered[ids[0]], fetched(encoder, a)) and torch.equal(inst.gathered[ids[1]],
                                                                                  fetched(encoder, b))


def test_pins_released_when_vllm_finishes(encoders, checkpoints, shm_dir, vllm_instance):
    encoder = encoders["qwen2_5_vl"]
    inst = vllm_instance(checkpoints["qwen2_5_vl"], ec_config(encoder.url, shm="on", shm_dir=str(shm_dir)))
    released = []
    fetcher = inst.connector.table.fetcher
    real_release = fetcher.release
    fetcher.release = lambda ids: (released.append(list(ids)), real_release(ids))
    with encoder.client() as c:
        a, b = c.encode([png(224, 168, 2301), png(84, 140, 2302)])
    assert inst.run([inst.request("p", chat([a, b, a]))]) == {"p": OK}
    inst.connector.table._pool.shutdown(wait=True)
    assert released == [sorted({a.id, b.id})]
    with encoder.client() as c:  # released once: the one pin of the encode is gone
        assert c.release([a.id, b.id]) == 0

