"""SGLang's encoder protocol (--sglang-protocol) on the real service, spoken to as SGLang's language side
speaks it: POST /encode and /scheduler_receive_url in either order, the push read from a plain pyzmq PULL
and its header walked without unpickling (tests/support/sglang_header.py). SGLang's own receiver code runs
against the service in tests/engines/sglang/."""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
import uuid

import httpx
import pytest
import torch
import zmq

from encoder_service.cache import make_key
from encoder_service.core import ImageInput
from tests.support.images import data_url, image_bytes
from tests.support.service import running
from tests.support.sglang_header import walk
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sglang_service(request, tiny_checkpoint):
    return running(request, tiny_checkpoint("qwen2_5_vl"), "--sglang-protocol")


@pytest.fixture(scope="module")
def sglang_service_qwen3(request, tiny_checkpoint):
    return running(request, tiny_checkpoint("qwen3_vl"), "--sglang-protocol")


class Pull:
    """A language-side PULL socket on a random loopback port (what SGLang binds)."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"

    def recv(self, timeout_s: float = 30) -> list[bytes]:
        assert self.sock.poll(int(timeout_s * 1000)), "nothing pushed"
        return self.sock.recv_multipart()

    def empty(self, wait_s: float = 0.3) -> bool:
        return not self.sock.poll(int(wait_s * 1000))

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def pull():
    p = Pull()
    yield p
    p.close()



def encode_body(req_id, items, *, num_parts=1, part_idx=0, embedding_port=None) -> dict:
    # The body SGLang 0.5.23 sends (receiver.py MMReceiverHTTP.encode), extra fields included.
    return {"encoder_idx": 0, "encoder_url": "http://x", "mm_items": items, "num_parts": num_parts,
            "part_idx": part_idx, "req_id": req_id, "modality": "IMAGE", "prefill_host": "127.0.0.1",
            "embedding_port": embedding_port, "time_stats_json": None}


def register(svc, req_id, address, count=1) -> httpx.Response:
    return httpx.post(f"{svc.sglang_url}/scheduler_receive_url", timeout=30,
                      json={"req_id": req_id, "receive_count": count, "receive_url": address, "modality": "IMAGE"})


def core_rows(svc, images: list[bytes]) -> list[torch.Tensor]:
    async def go():
        return await svc.core.encode([ImageInput(data=b) for b in images], wait=True, return_embeddings=True)

    return svc.call(go).embeddings


def images_encoded(svc) -> float:
    return svc.sample("encoder_images_encoded_total")


def check_push(svc, frames, req_id, images, *, num_parts=1, part_idx=0):
    """The part's header fields and rows: the core's rows of `images`, concatenated in item order."""
    assert len(frames) == 2
    kind, cls, state = walk(frames[0])
    assert cls == ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
    assert (state["req_id"], state["num_parts"], state["part_idx"]) == (req_id, num_parts, part_idx)
    expect = core_rows(svc, images)
    infos = svc.call(lambda: svc.core.encode([ImageInput(data=b) for b in images])).images
    assert state["grid_dim"] == [list(i.grid_thw) for i in infos]
    assert state["dtype"] == ("torch", svc.core.dtype) and state["error_msg"] is None
    rows = torch.cat(expect)
    assert state["shape"] == list(rows.shape) and rows.shape[1] == svc.core.spec.row_width
    got = torch.frombuffer(bytearray(frames[1]), dtype=rows.dtype).reshape(rows.shape)
    assert torch.equal(got, rows)  # bit for bit


def encode_open(svc, req_id: str) -> bool:
    """Whether the part's /encode has arrived (read on the service's loop: the part table is confined to it)."""

    async def read() -> bool:
        part = svc.service._sglang_protocol.sessions.get(req_id)
        return part is not None and part.encoding

    return svc.call(read)


def post_encode_in_thread(svc, body):
    out = {}

    def go():
        out["r"] = httpx.post(f"{svc.sglang_url}/encode", json=body, timeout=60)

    t = threading.Thread(target=go)
    t.start()
    return t, out


def test_off_by_default(service):
    assert service.settings.server.sglang_protocol is False
    assert service.sglang_url is None and service.service._sglang is None  # no server, no socket bound


def test_health(sglang_service):
    r = httpx.get(f"{sglang_service.sglang_url}/health", timeout=5)
    assert r.status_code == 200
    assert httpx.get(f"{sglang_service.url}/health/ready", timeout=5).status_code == 200  # the others still serve


def test_scheduler_transport_registration_first_and_dedup(sglang_service, pull):
    svc = sglang_service
    a, b = image_bytes(90, 60, seed=101), image_bytes(40, 130, seed=102)
    before = images_encoded(svc)
    rid = f"{uuid.uuid4().hex}_local_part_0"
    assert register(svc, rid, pull.address).status_code == 200  # the rank registers before /encode
    r = httpx.post(f"{svc.sglang_url}/encode", json=encode_body(rid, [data_url(a), data_url(b), data_url(a)]),
                   timeout=60)
    assert r.status_code == 200 and r.json() is None  # SGLang's encoder answers `null`
    check_push(svc, pull.recv(), rid, [a, b, a])
    assert images_encoded(svc) - before == 2  # `a` twice in the request: encoded once


def test_scheduler_transport_registration_after_encode(sglang_service, pull):
    svc = sglang_service
    a = image_bytes(64, 64, seed=103)
    core_rows(svc, [a])  # cached already: sent again, it is not encoded again
    before = images_encoded(svc)
    rid = f"{uuid.uuid4().hex}_local_part_1"
    t, out = post_encode_in_thread(svc, encode_body(rid, [base64.b64encode(a).decode()], num_parts=2, part_idx=1))
    wait_for(lambda: encode_open(svc, rid), "the /encode to arrive")
    # Waiting for the registration: no event marks it. 0.3 s lets a push sent without one arrive (the image is
    # cached: its rows are ready at once); a slower machine can only hide such a push, never fail this.
    assert t.is_alive() and pull.empty(0.3)
    assert register(svc, rid, pull.address).status_code == 200
    check_push(svc, pull.recv(), rid, [a], num_parts=2, part_idx=1)
    t.join(30)
    assert out["r"].status_code == 200 and images_encoded(svc) == before


def test_every_tp_rank_gets_a_copy(sglang_service):
    svc = sglang_service
    ranks = [Pull(), Pull()]
    try:
        a = image_bytes(50, 50, seed=104)
        rid = f"{uuid.uuid4().hex}_local_part_0"
        t, out = post_encode_in_thread(svc, encode_body(rid, [data_url(a)]))
        register(svc, rid, ranks[0].address, count=2)
        wait_for(lambda: encode_open(svc, rid), "the /encode to arrive")
        # 1 of 2 ranks: nothing yet. No event marks the wait for the second: 0.3 s lets a push sent to the
        # first alone arrive (a slower machine can only hide one, never fail this).
        assert ranks[0].empty(0.3)
        register(svc, rid, ranks[1].address, count=2)
        first, second = ranks[0].recv(), ranks[1].recv()
        assert first == second
        check_push(svc, first, rid, [a])
        t.join(30)
        assert out["r"].status_code == 200
    finally:
        for p in ranks:
            p.close()


def test_an_encode_leaves_no_pins_behind(sglang_service, pull):
    """The rows are pushed, never fetched: /encode ends its images' leases, or they would hold
    --max-pinned-bytes for --lease-s."""
    svc = sglang_service
    a = image_bytes(62, 46, seed=109)
    rid = uuid.uuid4().hex + "_local_part_0"
    r = httpx.post(f"{svc.sglang_url}/encode", timeout=60, json=encode_body(rid, [data_url(a)] * 2,
                                                                          embedding_port=pull.port))
    assert r.status_code == 200 and len(pull.recv()) == 2
    name = make_key(a, svc.core.model_fp, svc.core.settings.cache.hash).name

    async def state():
        return svc.core.store.local.is_pinned(name), svc.core.store.peek(name) is not None

    assert svc.call(state) == (False, True)  # not pinned, still cached


def test_tokenizer_transport(sglang_service_qwen3, pull):
    svc = sglang_service_qwen3
    images = [image_bytes(70, 50, seed=105), image_bytes(33, 90, seed=106)]
    rid = uuid.uuid4().hex + "_local_part_0"
    r = httpx.post(f"{svc.sglang_url}/encode", timeout=60,
                   json=encode_body(rid, [data_url(b) for b in images], embedding_port=pull.port))
    assert r.status_code == 200
    frames = pull.recv()
    check_push(svc, frames, rid, images)
    spec = svc.core.spec
    assert spec.row_width == 4 * spec.out_hidden_size  # [main | deepstack_1..3] in one row, as SGLang splits it


def test_error_reaches_registered_and_late_ranks(sglang_service, pull):
    svc = sglang_service
    rid = f"{uuid.uuid4().hex}_local_part_0"
    register(svc, rid, pull.address, count=2)
    bad = data_url(b"not an image at all")
    r = httpx.post(f"{svc.sglang_url}/encode", json=encode_body(rid, [bad]), timeout=60)
    assert r.status_code == 400
    body = r.json()
    assert body["status"] == "error" and body["req_id"] == rid and body["message"].startswith("encoder_service: ")
    (frame,) = pull.recv()  # a single frame
    _, _, state = walk(frame)
    assert state["error_msg"] == body["message"] and state["error_code"] == 400 and state["req_id"] == rid
    late = Pull()
    try:
        assert register(svc, rid, late.address, count=2).status_code == 200
        (frame,) = late.recv()
        assert walk(frame)[2]["error_msg"] == body["message"]
    finally:
        late.close()


def test_a_reused_req_id_is_409_and_does_not_disturb_the_first(sglang_service, pull):
    """A req_id names one part: a second /encode of it while the first runs, with other images or the same,
    is a Conflict naming the req_id (SGLang's protocol carries no per-image ids: the req_id is its id)."""
    svc = sglang_service
    a, b = image_bytes(48, 48, seed=108), image_bytes(64, 48, seed=109)
    rid = f"{uuid.uuid4().hex}_local_part_0"
    t, out = post_encode_in_thread(svc, encode_body(rid, [data_url(a)]))
    wait_for(lambda: encode_open(svc, rid), "the first /encode to arrive")  # it waits for its rank
    for images in ([b], [a]):
        r = httpx.post(f"{svc.sglang_url}/encode", json=encode_body(rid, [data_url(d) for d in images]), timeout=60)
        assert r.status_code == 409 and f"req_id {rid!r} is already being encoded" in r.json()["message"], r.text
    register(svc, rid, pull.address)
    check_push(svc, pull.recv(), rid, [a])  # the rows, not an error header
    t.join(30)
    assert out["r"].status_code == 200


def test_error_to_the_tokenizer_port(sglang_service, pull):
    svc = sglang_service
    rid = uuid.uuid4().hex + "_local_part_0"
    r = httpx.post(f"{svc.sglang_url}/encode", timeout=60,
                   json=encode_body(rid, ["/etc/passwd"], embedding_port=pull.port))
    assert r.status_code == 400 and "local file paths are never read" in r.json()["message"]
    (frame,) = pull.recv()
    assert "local file paths" in walk(frame)[2]["error_msg"]

    async def part():
        return svc.service._sglang_protocol.sessions.get(rid)

    assert svc.call(part) is None  # the failed part is not kept (it would hold a slot until its TTL)


@pytest.mark.parametrize("change, status, needle", [
    (dict(mm_items=["aGk="] * 9), 400, "number of images in the request is 9, over the limit of 8"),
    (dict(mm_items=["https://example.com/a.png"]), 400, "url images are disabled"),
    (dict(mm_items=[data_url(b"\x00" * (3 << 20))]), 413, "request body"),
    (dict(modality="AUDIO"), 400, "images and videos"),
    (dict(part_idx=3), 400, "part_idx must be in [0, 1)"),
    (dict(num_parts="1"), 400, "bad JSON body"),
])
def test_limits_and_bad_requests(sglang_service, change, status, needle):
    body = encode_body(uuid.uuid4().hex, ["aGk="], embedding_port=None) | change
    r = httpx.post(f"{sglang_service.sglang_url}/encode", json=body, timeout=60)
    assert r.status_code == status and needle in r.json()["message"], r.text


def test_vanished_receiver_fails_in_bounded_time(sglang_service):
    svc = sglang_service
    pusher = svc.service._sglang_protocol.pusher
    saved, pusher.send_timeout_s = pusher.send_timeout_s, 0.5
    try:
        gone = Pull()
        port = gone.port
        gone.close()  # nobody listens there any more
        rid = uuid.uuid4().hex + "_local_part_0"
        t0 = time.monotonic()
        r = httpx.post(f"{svc.sglang_url}/encode", timeout=60,
                       json=encode_body(rid, [data_url(image_bytes(30, 30, seed=107))], embedding_port=port))
        assert r.status_code == 503 and "timed out" in r.json()["message"]
        assert time.monotonic() - t0 < 20
    finally:
        pusher.send_timeout_s = saved


def test_registration_validation(sglang_service):
    for bad in ({"receive_url": "nohost"}, {"receive_count": 0}, {"req_id": ""}):
        body = {"req_id": "r", "receive_count": 1, "receive_url": "127.0.0.1:1", "modality": "IMAGE"} | bad
        r = httpx.post(f"{sglang_service.sglang_url}/scheduler_receive_url", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["status"] == "error", r.text


def test_a_client_gone_mid_upload_is_cancelled_not_an_error(sglang_service, caplog):
    svc = sglang_service

    def cancelled() -> float:
        return svc.sample("encoder_requests_total", {"transport": "sglang", "method": "encode", "outcome": "cancelled"})

    caplog.set_level(logging.DEBUG)
    before = cancelled()
    host, port = svc.sglang_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b"{" * 1000)
        time.sleep(0.2)  # the server reads the body; then the client goes away with 99% of it unsent
    wait_for(lambda: cancelled() > before, "the upload cancelled", 10, poll_s=0.05)  # the server learns of it later
    assert cancelled() - before == 1
    assert not [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_part(family, sglang_service, sglang_service_qwen3, pull):
    """A VIDEO part (two videos, one sampled by its preprocess_kwargs): Modality.VIDEO, a grid per video, the
    rows of both in order, and what SGLang's language side needs for the prompt and M-RoPE."""
    from encoder_service.core.types import VideoInput
    from tests.support.video_cases import make_clip

    svc = sglang_service if family == "qwen2_5_vl" else sglang_service_qwen3
    a, b = make_clip("mp4_h264", frames=7, width=96, height=64), make_clip("webm_vp9", frames=9, width=64, height=64)
    rid = f"{uuid.uuid4().hex}_local_part_0"
    body = encode_body(rid, ["data:video/mp4;base64," + base64.b64encode(a).decode(),
                             {"url": base64.b64encode(b).decode(), "preprocess_kwargs": {"num_frames": 4}}])
    r = httpx.post(f"{svc.sglang_url}/encode", json=body | {"modality": "VIDEO", "embedding_port": pull.port},
                   timeout=60)
    assert r.status_code == 200, r.text
    frames = pull.recv()
    _, _, state = walk(frames[0])
    expect = svc.call(lambda: svc.core.encode([], videos=[VideoInput(data=a), VideoInput(data=b, num_frames=4)],
                                              return_embeddings=True))
    assert state["modality"][2] == (2,) and state["grid_dim"] == [list(v.video_grid_thw) for v in expect.videos]
    rows = torch.cat(expect.embeddings)
    assert state["shape"] == list(rows.shape)
    assert torch.equal(torch.frombuffer(bytearray(frames[1]), dtype=rows.dtype).reshape(rows.shape), rows)
    if family == "qwen3_vl":
        assert state["video_timestamps"] == [list(v.group_timestamps) for v in expect.videos]
        assert state["second_per_grid_ts"] is None
    else:
        assert state["second_per_grid_ts"] == [v.second_per_grid_t for v in expect.videos]
        assert state["video_timestamps"] is None
