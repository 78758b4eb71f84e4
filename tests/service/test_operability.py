"""What an operator sees, over a real service and a real redis-server: /metrics carries the cache's own
counters (host LRU tier, leases, Redis tier, shared-memory writer; core/cache_metrics.py), parsed as
Prometheus parses them, and they move as the service encodes, evicts and loses Redis. Readiness reports
Redis's state as detail and stays ready without it; liveness never looks at Redis, and neither probe sends
Redis anything (nor uses the pub/sub connection a fetch's wait opened). Every request of every transport
has a request id (the caller's x-request-id, else one made here), echoed in its answer and named by its
log lines, and with --access-log one access line; encoder_build_info says what runs.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from encoder_service.cache import key_from_id
from encoder_service.client import EncoderClient
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc
from tests.support.images import image_bytes
from tests.support.service import RunningService, make_settings, running

pytestmark = pytest.mark.timeout(120)

LEASE_S = 3  # short, so the test sees leases end; long enough for an encode under load


def scrape(c: httpx.Client) -> dict[str, float]:
    """GET /metrics, parsed: {sample name with its labels as name{k=v,...}: value}."""
    out = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def encode(c: httpx.Client, seed: int) -> dict:
    r = c.post("/v1/encode?wait=true", content=image_bytes(64, 64, seed), headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    return r.json()["images"][0]  # 4 rows x 48 x float32: 768 bytes


@pytest.fixture
def redis_service(request, redis_server, tiny_checkpoint, tmp_path) -> RunningService:
    ckpt = tiny_checkpoint("qwen2_5_vl")
    svc = RunningService(make_settings(
        ckpt, "--redis-url", redis_server.url, "--cache-bytes", "8KiB", "--max-pinned-bytes", "4KiB",
        "--lease-s", str(LEASE_S), "--shm-fetch", "--shm-dir", str(tmp_path), grpc=False), ckpt)
    request.addfinalizer(svc.close)
    return svc


def test_metrics_carry_the_cache_redis_and_shm_counters(redis_service, tmp_path):
    svc = redis_service
    with httpx.Client(base_url=svc.url, timeout=30) as c:
        m = scrape(c)
        assert m["encoder_cache_redis_up"] == 1 and m["encoder_cache_redis_writes_paused"] == 0
        assert m["encoder_cache_local_capacity_bytes"] == 8192 and m["encoder_cache_max_pinned_bytes"] == 4096
        assert m["encoder_cache_misses_total"] == m["encoder_cache_local_evictions_total"] == 0
        assert m["encoder_shm_writes_total"] == m["encoder_shm_open_mappings"] == 0

        ids = []
        for k in range(16):  # 16 x 768 bytes through an 8 KiB tier, each released: the oldest go
            ids.append(encode(c, k)["id"])
            assert scrape(c)["encoder_cache_pinned_bytes"] == 768  # until the release
            assert c.post("/v1/release", json={"ids": ids[-1:]}).json() == {"released": 1, "invalid": []}
        m = scrape(c)
        assert m["encoder_cache_misses_total"] == 16 and m["encoder_images_encoded_total"] == 16
        assert m["encoder_cache_local_evictions_total"] == 16 - m["encoder_cache_local_entries"] > 0
        assert m["encoder_cache_local_used_bytes"] == 768 * m["encoder_cache_local_entries"] <= 8192
        assert m["encoder_cache_pinned_bytes"] == m["encoder_cache_pinned_ids"] == 0

        svc.call(svc.core.replicas.redis.flush)  # the write-behind has landed
        m = scrape(c)
        assert m["encoder_cache_redis_writes_total"] == 16 and m["encoder_cache_redis_write_queue_bytes"] == 0
        assert m["encoder_cache_redis_dropped_writes_total{reason=failed}"] == 0
        assert m["encoder_cache_redis_dropped_writes_total{reason=backlog_full}"] == 0

        with EncoderClient.http(svc.url, shm=True, shm_dir=str(tmp_path)) as client:
            assert client.fetch([(ids[-1], 0)], 0, 4).rows.shape == (4, 48)
        m = scrape(c)
        assert m["encoder_shm_writes_total"] == m["encoder_shm_opens_total"] == 1
        assert m["encoder_shm_written_bytes_total"] == 4 * 48 * 4 and m["encoder_shm_copy_seconds_total"] > 0

        statuses = []
        for k in range(16, 22):  # no releases, no waits: 4 KiB of pins fill up at the 6th image
            r = c.post("/v1/encode", content=image_bytes(64, 64, k), headers={"content-type": "image/png"})
            statuses.append(r.status_code)
        assert statuses == [200] * 5 + [429]
        m = scrape(c)
        assert m["encoder_cache_pin_refusals_total"] == 1 and m["encoder_cache_pinned_bytes"] > 0
        time.sleep(LEASE_S + 0.2)  # the leases end: a scrape sees it (they expire lazily, on any store call)
        m = scrape(c)
        assert m["encoder_cache_pinned_bytes"] == 0 and m["encoder_cache_lease_expiries_total"] == 5


def test_readiness_reports_redis_down_and_stays_ready(redis_service, redis_server):
    svc = redis_service
    commands = redis.Redis.from_url(redis_server.url)

    def processed() -> int:
        return commands.info("stats")["total_commands_processed"]  # counts this INFO too

    with httpx.Client(base_url=svc.url, timeout=30) as c:
        # An id another replica is encoding: this fetch's wait opens the tier's pub/sub connection, which
        # stays open (idle) after it; the probes must not use it either.
        pending = key_from_id("cd" * 16, svc.core.model_fp, svc.core.settings.cache.hash)
        assert svc.call(svc.core.replicas.mark_pending, [pending])
        r = c.post("/v1/fetch", json={"items": [{"id": "cd" * 16, "offset": 0}], "start": 0, "end": 4,
                                      "timeout_s": 0.2})
        assert r.status_code == 504 and svc.sample("encoder_cache_redis_subscriber_connects_total") == 1
        before = processed()
        assert c.get("/health/live").json() == {"live": True}
        address = f"127.0.0.1:{redis_server.port}"
        assert c.get("/health/ready").json() == {"ready": True, "redis": "up", "redis_detail": {
            "mode": "standalone", "state": "up", "nodes": {address: "up"}, "pubsub": "plain"}}
        assert processed() == before + 1  # the probes sent Redis nothing: state is what the tier last saw
        commands.close()

        redis_server.kill()
        r = c.post("/v1/fetch", json={"items": [{"id": "ab" * 16, "offset": 0}], "start": 0, "end": 4})
        # Not here, and the tier (down now: its header read failed) cannot say whether another replica has it.
        assert r.status_code == 503 and "Redis tier" in r.json()["error"]["message"]
        r = c.get("/health/ready")
        assert r.status_code == 200 and r.json()["redis"] == "down"
        assert r.json()["redis_detail"]["nodes"] == {address: "down"}
        assert c.get("/health/live").status_code == 200
        m = scrape(c)
        assert m["encoder_cache_redis_up"] == 0 and m["encoder_cache_redis_down_events_total"] == 1
        info = encode(c, 99)  # the local tier serves on
        assert info["num_tokens"] == 4


# ---- request ids, the access log, build info --------------------------------------------------------------
@pytest.fixture(scope="module")
def logged_service(request, tiny_checkpoint) -> RunningService:
    return running(request, tiny_checkpoint("qwen2_5_vl"), "--access-log", "--sglang-protocol")


def test_request_ids_are_echoed_logged_and_each_request_has_an_access_line(logged_service, caplog):
    svc = logged_service
    caplog.set_level(logging.INFO, logger="encoder_service.access")
    with httpx.Client(base_url=svc.url, timeout=30) as c:
        r = c.post("/v1/encode", content=image_bytes(64, 64, 200),
                   headers={"content-type": "image/png", "x-request-id": "trace-7"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7"
        unknown = {"items": [{"id": "ab" * 16, "offset": 0}], "start": 0, "end": 4}
        r = c.post("/v1/fetch", json=unknown, headers={"x-request-id": "not a sane id"})  # replaced
        made = r.headers["x-request-id"]
        assert r.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", made)
        assert c.post("/v1/release", json={"ids": []}).headers["x-request-id"] != made  # one id per request
    with grpc.insecure_channel(svc.grpc_address) as channel:
        stub = pb_grpc.EncoderStub(channel)
        _, call = stub.Encode.with_call(pb.EncodeRequest(images=[pb.Image(data=image_bytes(64, 64, 201))]),
                                        metadata=(("x-request-id", "trace-8"),), timeout=30)
        assert ("x-request-id", "trace-8") in call.trailing_metadata()
        assert any(k == "x-timing-total-ms" for k, _ in call.trailing_metadata())  # the timings are kept
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Fetch(pb.FetchRequest(items=[pb.FetchItem(id="ab" * 16, offset=0)], start=0, end=4),
                            metadata=(("x-request-id", "trace-9"),), timeout=30))
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert ("x-request-id", "trace-9") in failed.value.trailing_metadata()
    r = httpx.post(f"{svc.sglang_url}/scheduler_receive_url", headers={"x-request-id": "trace-10"}, timeout=30,
                   json={"req_id": "r1", "receive_count": 1, "receive_url": "127.0.0.1:1", "modality": "IMAGE"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-10"

    lines = {rec.request_id: rec.getMessage() for rec in caplog.records if rec.name == "encoder_service.access"}
    assert re.fullmatch(r"http encode ok \d+\.\d{6}s request_id=trace-7", lines["trace-7"])
    assert lines[made].startswith("http fetch not_found ")
    assert lines["trace-8"].startswith("grpc encode ok ") and lines["trace-9"].startswith("grpc fetch not_found ")
    assert lines["trace-10"].startswith("sglang register ok ")


def test_build_info_and_the_transport_label(logged_service):
    import importlib.metadata
    import subprocess

    import torch

    import encoder_service

    svc = logged_service
    with httpx.Client(base_url=svc.url, timeout=30) as c:
        c.post("/v1/release", json={"ids": []})
        text = c.get("/metrics").text
    (info,) = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "encoder_build_info"]
    root = Path(encoder_service.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert info.value == 1 and info.labels == {
        "version": encoder_service.__version__, "commit": commit.strip() or "unknown", "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"), "attention": "auto", "preprocess": "pil"}
    assert svc.sample("encoder_requests_total", {"transport": "http", "method": "release", "outcome": "ok"}) >= 1
    assert svc.sample("encoder_request_seconds_count", {"transport": "http", "method": "release"}) >= 1


def test_the_build_commit_comes_from_the_image_first():
    from encoder_service.core.metrics import build_labels

    labels = build_labels(attention="fa4", preprocess="torchvision", env={"ENCODER_GIT_COMMIT": "0123abc"})
    assert (labels["commit"], labels["attention"], labels["preprocess"]) == ("0123abc", "fa4", "torchvision")
