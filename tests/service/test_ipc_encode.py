"""An encode answer carrying the IPC hold (issue 40 item 3): a same-host caller that wants the rows at once makes
one request, not two. Against the real server with the device row arena on the host stand-in
(encoder_service/testing/host_ipc.py):

  - `client.encode(images, out=...)`: each image's answer carries its placement and hold; the client copies
    the rows into `out` with no fetch request at all, bit for bit the socket fetch's, and the pins end at the
    acknowledgements;
  - over HTTP: JSON `"ipc"` and the query's `ipc_host` (multipart) alike; a hold's lease counts the encode's
    time too;
  - fallbacks, each with no error to the caller: IPC off on the server, another host, rows not in the arena
    (the client fetches them as `fetch` would); a video with "ipc" is a 400 naming why.
"""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from encoder_service.client import EncoderClient
from encoder_service.protocol.ipc import this_host
from encoder_service.testing.host_ipc import HostStandInReader
from tests.service.test_ipc_fetch import ipc_service, nan_out
from tests.support.images import image_bytes as png
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("encode-ipc")


@pytest.fixture(scope="module")
def svc(request, tiny_checkpoint, standin_dir):
    service = ipc_service(tiny_checkpoint("qwen3_vl"), standin_dir, "--ipc-lease-s", "30")
    request.addfinalizer(service.close)
    return service


def fetch_requests(svc) -> float:
    return sum(svc.sample("encoder_requests_total", {"transport": t, "method": "fetch", "outcome": "ok"})
               for t in ("http", "channel"))


def references(svc, infos) -> dict[str, torch.Tensor]:
    with EncoderClient.http(svc.url, timeout=WAIT_S, ipc="off") as w:
        return {i.id: w.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos}


def test_an_encode_carries_the_holds_and_the_rows_come_without_a_fetch(svc, standin_dir):
    images = [png(112, 112, 301), png(84, 140, 302), png(112, 112, 301)]  # one twice: one hold for both
    outs: dict[int, torch.Tensor] = {}

    def out(info):
        outs[len(outs)] = nan_out(info.num_tokens, info.row_width)
        return outs[len(outs) - 1]

    before = fetch_requests(svc)
    with EncoderClient.http(svc.url, timeout=WAIT_S, ipc=HostStandInReader(str(standin_dir))) as c:
        infos = c.encode(images, out=out)
        assert c.fetch_paths == {"ipc": 3}
    assert fetch_requests(svc) == before  # one request: the encode
    refs = references(svc, infos)
    assert all(torch.equal(outs[k], refs[info.id]) for k, info in enumerate(infos))
    wait_for(lambda: svc.sample("encoder_ipc_arena_holds") == 0, "the holds acknowledged", WAIT_S)
    assert not any(svc.pinned(info.id) for info in infos)  # delivered at the acknowledgements: pins ended


@pytest.mark.parametrize("form", ["json", "multipart"])
def test_the_http_encode_answers_each_images_hold(svc, form):
    data = png(112, 112, 303 if form == "json" else 304)
    if form == "json":
        body = {"images": [{"data": base64.b64encode(data).decode()}], "ipc": {"host": this_host()}}
        r = httpx.post(svc.url + "/v1/encode", json=body, timeout=WAIT_S)
    else:
        r = httpx.post(svc.url + "/v1/encode", files=[("image", ("a.png", data))], params={"ipc_host": this_host()},
                       timeout=WAIT_S)
    (image,) = r.json()["images"]
    ipc = image["ipc"]
    assert len(ipc["offsets"]) == 1 and len(ipc["token"]) == 32 and ipc["lease_s"] >= 30
    assert svc.pinned(image["id"])  # until the acknowledgement
    ack = httpx.post(svc.url + "/v1/fetch/ack", json={"tokens": [ipc["token"]]}, timeout=WAIT_S).json()
    assert ack == {"released": 1} and not svc.pinned(image["id"])


def test_a_consumer_on_another_host_is_told_so(svc):
    body = {"images": [{"data": base64.b64encode(png(56, 56, 305)).decode()}], "ipc": {"host": "another-host"}}
    (image,) = httpx.post(svc.url + "/v1/encode", json=body, timeout=WAIT_S).json()["images"]
    assert "another host" in image["ipc"]["unavailable"] and "embedding" not in image


def test_a_server_without_an_arena_answers_off_and_the_client_fetches(service):
    body = {"images": [{"data": base64.b64encode(png(56, 56, 306)).decode()}], "ipc": {"host": this_host()}}
    (image,) = httpx.post(service.url + "/v1/encode", json=body, timeout=WAIT_S).json()["images"]
    assert "off" in image["ipc"]["unavailable"]
    with EncoderClient.http(service.url, timeout=WAIT_S, ipc=HostStandInReader()) as c:
        out = nan_out(image["num_tokens"], image["row_width"])
        c.encode([png(56, 56, 306)], out=lambda info: out)
        assert c.fetch_paths == {"socket": 1}
        assert torch.equal(out, c.fetch([(image["id"], 0)], 0, image["num_tokens"]).rows)


def test_rows_not_in_the_arena_are_fetched(tiny_checkpoint, standin_dir):
    small = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, "--ipc-arena-bytes", "1KiB")
    try:
        with EncoderClient.http(small.url, timeout=WAIT_S, ipc=HostStandInReader(str(standin_dir))) as c:
            got = {}
            (info,) = c.encode([png(112, 112, 307)], out=lambda i: got.setdefault(
                "out", nan_out(i.num_tokens, i.row_width)))
            assert c.fetch_paths == {"socket": 1}  # told why in the answer: fetched
            assert "not in the device arena" in info.ipc.reason
        assert torch.equal(got["out"], references(small, [info])[info.id])
    finally:
        small.close()


def test_a_video_with_ipc_is_a_400(svc):
    body = {"videos": [{"frames": [base64.b64encode(png(56, 56, 308)).decode()] * 2}], "ipc": {"host": this_host()}}
    r = httpx.post(svc.url + "/v1/encode", json=body, timeout=WAIT_S)
    assert r.status_code == 400 and "images only" in r.json()["error"]["message"]
