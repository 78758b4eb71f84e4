"""HTTP API against a real uvicorn server on 127.0.0.1 with tiny random models (tests/support/service.py).

How HTTP maps the core (tests/unit/test_core.py tests the core itself): the three encode body forms, the
fetch payloads, status codes, headers, auth and body limits. Embeddings are checked against the tower's own
output; bad input (strict JSON types included) against a 4xx naming the problem with the server still
serving. A client gone mid-upload is the outcome `cancelled` (no ERROR logged); a bug is a 500 `internal`,
logged once.
"""

from __future__ import annotations

import base64
import http.client
import logging
import re
import socket
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from encoder_service.protocol import wire
from encoder_service.protocol.dtypes import torch_dtype
from tests.support.images import image_bytes, png_header_only, truncated_jpeg
from tests.support.reference import assert_close, reference_rows
from tests.support.waits import wait_for


TIMEOUT = httpx.Timeout(30.0)


# ---- helpers ---------------------------------------------------------------------------------------------
def client(svc, **kw) -> httpx.Client:
    return httpx.Client(base_url=svc.url, timeout=TIMEOUT, **kw)


def encode_json(c: httpx.Client, images: list[bytes], **opts) -> httpx.Response:
    body = {"images": [{"data": base64.b64encode(d).decode()} for d in images], **opts}
    return c.post("/v1/encode", json=body)


def embedding_of(d: dict) -> torch.Tensor:
    e = d["embedding"]
    flat = torch.frombuffer(bytearray(base64.b64decode(e["data"])), dtype=torch_dtype(e["dtype"]))
    return flat.view(*e["shape"])


def images_encoded(svc) -> float:
    return svc.sample("encoder_images_encoded_total")


def scraped(c: httpx.Client, sample: str) -> float:
    """One sample's value in GET /metrics (0 when absent)."""
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            if s.name == sample:
                return s.value
    return 0.0


def assert_still_serving(c: httpx.Client, seed: int = 999) -> None:
    assert c.get("/health/live").status_code == 200
    assert c.get("/health/ready").status_code == 200
    r = encode_json(c, [image_bytes(64, 64, seed)], wait=True)
    assert r.status_code == 200, r.text


# ---- round trips -----------------------------------------------------------------------------------------
def test_idle_keep_alive_connections_outlive_the_clients_own(service):
    """A connection idle past uvicorn's default keep-alive (5 s, httpx's own expiry too) is still open: the
    server never closes one that a client may be reusing at that moment (a ReadError for the client)."""
    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/health/live")
        assert conn.getresponse().read() == b'{"live":true}'
        sock = conn.sock
        time.sleep(5.5)
        conn.request("GET", "/health/live")  # on the same socket: http.client raises if the server closed it
        assert conn.getresponse().read() == b'{"live":true}' and conn.sock is sock
    finally:
        conn.close()


def test_health_metadata_metrics(service):
    with client(service) as c:
        assert c.get("/health/live").json() == {"live": True}
        assert c.get("/health/ready").json() == {"ready": True, "redis": "off"}
        meta = c.get("/v1/metadata").json()
        assert meta["family"] == "qwen2_5_vl" and meta["row_width"] == 48 and meta["layout"] == "main"
        assert meta["limits"]["max_images"] == 8
        text = c.get("/metrics").text
        assert "encoder_queue_depth" in text and "encoder_in_flight_requests" in text


def test_encode_multipart_binary_json_round_trip(service):
    a, b = image_bytes(100, 60, 1), image_bytes(50, 90, 2, "JPEG")
    with client(service) as c:
        r = c.post("/v1/encode?wait=true", files=[("image", ("a.png", a, "image/png")),
                                                   ("image", ("b.jpg", b, "image/jpeg"))])
        assert r.status_code == 200, r.text
        infos = r.json()["images"]
        assert len(infos) == 2 and infos[0]["cached"] is False
        for info in infos:
            t, h, w = info["grid_thw"]
            assert info["num_tokens"] == t * h * w // 4 and info["row_width"] == 48 and info["dtype"] == "float32"
        assert {"x-timing-decode-ms", "x-timing-queue-ms", "x-timing-encode-ms"} <= set(r.headers)

        r2 = c.post("/v1/encode", content=a, headers={"content-type": "application/octet-stream"})
        assert r2.status_code == 200 and r2.json()["images"][0]["id"] == infos[0]["id"]
        assert r2.json()["images"][0]["cached"] is True
        r3 = c.post("/v1/encode", content=b, headers={"content-type": "image/jpeg"})
        assert r3.json()["images"][0]["id"] == infos[1]["id"]

        r4 = encode_json(c, [a, b], return_embeddings=True)
        assert r4.status_code == 200, r4.text
        for d, data in zip(r4.json()["images"], (a, b)):
            rows = embedding_of(d)
            assert rows.shape == (d["num_tokens"], 48)
            assert_close(rows, reference_rows(service.checkpoint, data))


def test_caller_ids_and_fetch_while_encoding(service):
    data = image_bytes(120, 80, 3)
    with client(service) as c:
        body = {"images": [{"data": base64.b64encode(data).decode(), "id": "req-7/img-0"}]}
        info = c.post("/v1/encode", json=body).json()["images"][0]
        assert info["id"] == "u:req-7/img-0"
        fetched = scraped(c, "encoder_fetch_rows_total"), scraped(c, "encoder_fetch_bytes_total")
        # No wait: the fetch below waits for the encode still in flight.
        r = c.post("/v1/fetch", json={"items": [{"id": info["id"], "offset": 0}], "start": 0,
                                      "end": info["num_tokens"], "timeout_s": 20})
        assert r.status_code == 200, r.text
        header, rows = wire.decode_http(r.content)
        assert header.num_rows == info["num_tokens"]
        assert scraped(c, "encoder_fetch_rows_total") - fetched[0] == info["num_tokens"]
        assert scraped(c, "encoder_fetch_bytes_total") - fetched[1] == rows.numel() * rows.element_size()
        assert_close(rows, reference_rows(service.checkpoint, data))


def test_fetch_payload_per_accept(service):
    """octet-stream by default, safetensors when Accept asks: the same header and rows, in segment order
    (which rows a chunk holds is the core's: tests/unit/test_core.py)."""
    imgs = [image_bytes(w, h, 10 + i) for i, (w, h) in enumerate([(90, 60), (64, 64), (200, 40)])]
    with client(service) as c:
        r = encode_json(c, imgs, return_embeddings=True)
        assert r.status_code == 200, r.text
        infos = r.json()["images"]
        whole = [embedding_of(d) for d in infos]
        # Prompt: text(5), img0, img1 adjacent, text(3), img2, text(2).
        n0, n1, n2 = (d["num_tokens"] for d in infos)
        offsets = [5, 5 + n0, 5 + n0 + n1 + 3]
        prompt_len = offsets[2] + n2 + 2
        items = [{"id": d["id"], "offset": off} for d, off in zip(infos, offsets)]
        start, end = 6, prompt_len - 3  # the chunk splits img0 and img2
        r = c.post("/v1/fetch", json={"items": items, "start": start, "end": end})
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
        header, rows = wire.decode_http(r.content)
        assert [s.id for s in header.segments] == [d["id"] for d in infos]
        assert all(start <= s.position and s.position + s.num_rows <= end for s in header.segments)
        assert torch.equal(rows, torch.cat([w[s.row_start:s.row_end] for w, s in zip(whole, header.segments)]))
        r = c.post("/v1/fetch", json={"items": items, "start": 0, "end": prompt_len},
                   headers={"accept": "application/safetensors"})
        assert r.headers["content-type"] == "application/safetensors"
        header, rows = wire.decode_safetensors(r.content)
        assert [s.id for s in header.segments] == [d["id"] for d in infos]
        assert torch.equal(rows, torch.cat(whole))


# ---- bad input -------------------------------------------------------------------------------------------
BAD_ENCODES = {
    "invalid base64": ({"images": [{"data": "!!not base64!!"}]}, 400, "base64"),
    "not an image": ({"images": [{"data": base64.b64encode(b"hello, world").decode()}]}, 400, "image 0"),
    "zero bytes": ({"images": [{"data": ""}]}, 400, "empty"),
    "truncated jpeg": ({"images": [{"data": base64.b64encode(truncated_jpeg(5)).decode()}], "wait": True},
                       400, "trunc"),
    "truncated third image, waited for": (
        {"images": [{"data": base64.b64encode(image_bytes(40 + k, 40, 8)).decode()} for k in range(2)]
         + [{"data": base64.b64encode(truncated_jpeg(5)).decode()}], "wait": True}, 400, "image 2: "),
    "decompression bomb": ({"images": [{"data": base64.b64encode(png_header_only(60000, 60000)).decode()}]},
                           400, "pixel"),
    "zero-sized image": ({"images": [{"data": base64.b64encode(png_header_only(0, 10)).decode()}]}, 400, "image 0"),
    "aspect over 200": ({"images": [{"data": base64.b64encode(image_bytes(2, 450, 6)).decode()}]}, 400, "aspect"),
    "too many images": ({"images": [{"data": base64.b64encode(image_bytes(32, 32, 7)).decode()}] * 9},
                        400, "number of images"),
    "no images": ({"images": []}, 400, "no images"),
    "url images off": ({"images": [{"url": "http://example.com/a.png"}]}, 400, "url images are disabled"),
    "data and url": ({"images": [{"data": base64.b64encode(image_bytes(32, 32, 7)).decode(),
                                  "url": "http://example.com/a.png"}]},
                     400, "image 0: give exactly one of data or url"),
    "neither data nor url": ({"images": [{"id": "x"}]}, 400, "image 0: give exactly one of data or url"),
    "bad base64": ({"images": [{"data": "@@@"}]}, 400, "image 0: data: not valid base64"),
    "unknown field": ({"imgs": []}, 400, "bad JSON"),
    "wait as a string": ({"images": [{"data": base64.b64encode(image_bytes(32, 32, 7)).decode()}], "wait": "true"},
                         400, "wait: Input should be a valid boolean"),
    "timeout_s as a string": ({"images": [{"data": base64.b64encode(image_bytes(32, 32, 7)).decode()}],
                               "wait": True, "timeout_s": "5"}, 400, "timeout_s: Input should be a valid number"),
    "timeout_s as a bool": ({"images": [{"data": base64.b64encode(image_bytes(32, 32, 7)).decode()}],
                             "wait": True, "timeout_s": True}, 400, "timeout_s: Input should be a valid number"),
    "negative timeout_s": ({"images": [{"data": base64.b64encode(image_bytes(32, 32, 7)).decode()}],
                            "wait": True, "timeout_s": -1}, 400, "timeout_s must be a finite number of seconds >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_ENCODES))
def test_bad_encode_is_a_4xx_naming_the_problem(service, case):
    body, status, needle = BAD_ENCODES[case]
    with client(service) as c:
        r = c.post("/v1/encode", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert needle.lower() in err["message"].lower(), err
        assert_still_serving(c)


def _multipart(*parts: tuple[str, bytes, bool], boundary: str = "xyz") -> bytes:
    """A multipart body of (field name, content, as a file) parts."""
    out = b""
    for name, content, is_file in parts:
        filename = f'; filename="{name}.png"' if is_file else ""
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"{filename}\r\n\r\n".encode()
                + content + b"\r\n")
    return out + f"--{boundary}--\r\n".encode()


# (content type, body) -> 400 naming the problem (too many parts: test_limits_say_the_limit_and_what_was_sent).
BAD_MULTIPARTS = {
    "no boundary": ("multipart/form-data", b"x", "missing boundary"),
    "no boundary lines": ("multipart/form-data; boundary=xyz", b"x" * 64, "invalid multipart"),
    "a part without a name": ("multipart/form-data; boundary=xyz",
                              b"--xyz\r\nContent-Disposition: form-data\r\n\r\nabc\r\n--xyz--\r\n", '"name" must be'),
}


@pytest.mark.parametrize("case", list(BAD_MULTIPARTS))
def test_malformed_multipart_is_a_400_naming_the_problem(service, case):
    ctype, body, needle = BAD_MULTIPARTS[case]

    def internal() -> float:
        return service.sample("encoder_requests_total",
                              {"transport": "http", "method": "encode", "outcome": "internal"})

    before = internal()
    with client(service) as c:
        r = c.post("/v1/encode", content=body, headers={"content-type": ctype})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["kind"] == "invalid_input" and err["message"].startswith("multipart body: "), err
        assert needle in err["message"].lower(), err
        assert_still_serving(c)
    assert internal() == before


def test_limits_say_the_limit_and_what_was_sent(service):
    """Each limit a request goes over answers with the limit and what was sent (issue 31 item 8): the body's
    bytes with or without Content-Length; a multipart body's images, frames and parts, whether the images
    come as files or plain fields. The test service takes 8 images, 4 videos and 2 MiB bodies."""
    limits, max_videos = service.settings.limits, service.settings.video.max_videos
    assert (limits.max_images, max_videos, limits.max_body_bytes) == (8, 4, 2 << 20)
    parts_note = "(no request takes more: at most 8 images, --max-images, or 4 videos, --max-videos, one of them " \
                 "as up to 8 frame fields)"
    image = image_bytes(32, 32, 1)

    def multipart(c: httpx.Client, *parts: tuple[str, bytes, bool]) -> httpx.Response:
        return c.post("/v1/encode", content=_multipart(*parts), headers={"content-type": "multipart/form-data; "
                                                                                      "boundary=xyz"})

    with client(service) as c:
        r = c.post("/v1/encode", content=b"\0" * (3 << 20), headers={"content-type": "application/octet-stream"})
        assert r.status_code == 413 and r.json()["error"]["message"] == (
            "request body bytes (Content-Length) is 3145728, over the limit of 2097152 (--max-body-bytes)")
        r = c.post("/v1/encode", content=iter([b"\0" * (256 << 10)] * 12),  # chunked: no Content-Length
                   headers={"content-type": "application/octet-stream"})
        message = r.json()["error"]["message"]
        sent = re.fullmatch(r"request body bytes \(no Content-Length: counted while read\) is at least (\d+), "
                            r"over the limit of 2097152 \(--max-body-bytes\)", message)
        assert r.status_code == 413 and sent and 2097152 < int(sent[1]) <= 3 << 20, message
        for as_file in (True, False):
            r = multipart(c, *[("image", image, as_file)] * 9)
            assert r.status_code == 400 and r.json()["error"]["message"] == (
                "number of images in the request is 9, over the limit of 8"), r.text
        r = multipart(c, *[("frame", image, True)] * 9)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "number of frame fields in the multipart body is 9, over the limit of 8 (--max-images; JSON takes a "
            "video's frames up to --max-video-frames)"), r.text
        r = multipart(c, *[("image", image, True)] * 20)
        assert r.status_code == 400 and r.json()["error"] == {"kind": "limit", "message": (
            f"multipart body: number of file parts is at least 13, over the limit of 12 {parts_note}")}, r.text
        r = multipart(c, *[("note", b"n", False)] * 40)
        assert r.status_code == 400 and r.json()["error"] == {"kind": "limit", "message": (
            f"multipart body: number of plain fields is at least 29, over the limit of 28 {parts_note}")}, r.text
        assert_still_serving(c)


def test_routing_errors_answer_in_the_error_shape(service):
    with client(service) as c:
        for method, path, status, kind in (("GET", "/v1/encode", 405, "invalid_input"),
                                           ("POST", "/v1/metadata", 405, "invalid_input"),
                                           ("GET", "/v2/encode", 404, "not_found")):
            r = c.request(method, path)
            assert r.status_code == status and r.json()["error"]["kind"] == kind, r.text
            assert r.json()["error"]["message"].startswith(f"{method} {path}: "), r.text


def test_truncated_jpeg_without_wait_fails_at_fetch(service):
    with client(service) as c:
        info = encode_json(c, [truncated_jpeg(6)]).json()["images"][0]  # header is fine: answered
        r = c.post("/v1/fetch", json={"items": [{"id": info["id"], "offset": 0}], "start": 0, "end": 4})
        assert r.status_code == 400 and "trunc" in r.json()["error"]["message"].lower(), r.text
        assert_still_serving(c)


def test_a_reused_caller_id_with_other_bytes_is_409(service):
    a, b = image_bytes(70, 50, 60), image_bytes(50, 70, 61)
    with client(service) as c:
        r = c.post("/v1/encode?id=reused-http&wait=true", content=a, headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        first = r.json()["images"][0]
        for r in (c.post("/v1/encode?id=reused-http", content=b, headers={"content-type": "image/png"}),
                  c.post("/v1/encode", json={"images": [{"data": base64.b64encode(b).decode(), "id": "reused-http"}]})):
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["kind"] == "conflict" and "id 'u:reused-http' already names other image bytes" in err["message"]
        r = c.post("/v1/encode?id=reused-http", content=a, headers={"content-type": "image/png"})
        assert r.status_code == 200 and r.json()["images"][0] == first | {"cached": True}
        assert_still_serving(c)


def test_wrong_content_type_is_415(service):
    with client(service) as c:
        r = c.post("/v1/encode", content=b"hi", headers={"content-type": "text/plain"})
        assert r.status_code == 415 and "text/plain" in r.json()["error"]["message"]
        r = c.post("/v1/fetch", content=b"{}", headers={"content-type": "application/octet-stream"})
        assert r.status_code == 415


NOT_AN_INT = "Input should be a valid integer"


def test_bad_fetches(service):
    with client(service) as c:
        info = encode_json(c, [image_bytes(64, 64, 77)], wait=True).json()["images"][0]
        n, iid = info["num_tokens"], info["id"]
        cases = [
            ({"items": [{"id": "0" * 32, "offset": 0}], "start": 0, "end": 4}, 404, "unknown id"),
            ({"items": [{"id": "not-an-id", "offset": 0}], "start": 0, "end": 4}, 400, "malformed id"),
            ({"items": [{"id": "u:{braces}", "offset": 0}], "start": 0, "end": 4}, 400, "malformed id"),
            ({"items": [{"id": iid, "offset": 0}], "start": -1, "end": 4}, 400, "start"),
            ({"items": [{"id": iid, "offset": 0}], "start": 4, "end": 4}, 400, "end"),
            ({"items": [{"id": iid, "offset": -3}], "start": 0, "end": 4}, 400, "offset"),
            ({"items": [{"id": iid, "offset": 0}, {"id": iid, "offset": n - 1}], "start": 0, "end": 4},
             400, "overlap"),
            ({"items": [{"id": iid}], "start": 0, "end": 4}, 400, "offset"),
            # Numbers are strict ints: no strings, bools or floats standing in for them (400, not 422).
            ({"items": [{"id": iid, "offset": "5"}], "start": 0, "end": 4}, 400, "offset: " + NOT_AN_INT),
            ({"items": [{"id": iid, "offset": True}], "start": 0, "end": 4}, 400, "offset: " + NOT_AN_INT),
            ({"items": [{"id": iid, "offset": 0}], "start": "0", "end": 4}, 400, "start: " + NOT_AN_INT),
            ({"items": [{"id": iid, "offset": 0}], "start": 0, "end": 4.0}, 400, "end: " + NOT_AN_INT),
            ({"items": [{"id": iid, "offset": 0}], "start": 0, "end": 4, "timeout_s": "1"}, 400, "timeout_s"),
            ({"items": [{"id": iid, "offset": 0}], "start": 0, "end": 4, "timeout_s": -2}, 400, "timeout_s"),
            # Positions are int64 (all gRPC can carry), on HTTP too.
            ({"items": [{"id": iid, "offset": 2**63}], "start": 0, "end": 4}, 400, "offset must be < 2**63"),
            ({"items": [{"id": iid, "offset": 0}], "start": 0, "end": 2**63}, 400, "end must be < 2**63"),
            ({"items": [{"id": iid, "offset": 0}], "start": 2**64, "end": 2**64 + 1}, 400, "start must be < 2**63"),
        ]
        for body, status, needle in cases:
            r = c.post("/v1/fetch", json=body)
            assert r.status_code == status, (body, r.text)
            assert needle in r.json()["error"]["message"], (body, r.text)
        # A chunk past every image is valid and empty; the same image twice (not overlapping) is fine.
        r = c.post("/v1/fetch", json={"items": [{"id": iid, "offset": 0}, {"id": iid, "offset": n}],
                                      "start": n - 1, "end": n + 1})
        header, rows = wire.decode_http(r.content)
        assert [(s.row_start, s.row_end) for s in header.segments] == [(n - 1, n), (0, 1)]
        r = c.post("/v1/fetch", json={"items": [{"id": iid, "offset": 0}], "start": n + 5, "end": n + 9})
        assert r.status_code == 200 and wire.decode_http(r.content)[0].num_rows == 0
        last = 2**63 - 1  # the largest int64 position is fine
        r = c.post("/v1/fetch", json={"items": [{"id": iid, "offset": last - n}], "start": last - 1, "end": last})
        assert r.status_code == 200 and wire.decode_http(r.content)[0].segments[0].position == last - 1, r.text
        assert_still_serving(c)


def test_auth(auth_service):
    from tests.support.service import AUTH_TOKEN

    data = image_bytes(64, 64, 8)
    with client(auth_service) as c:
        assert c.get("/health/live").status_code == 200
        assert c.get("/health/ready").status_code == 200
        r = encode_json(c, [data])
        assert r.status_code == 401 and "missing bearer token" in r.json()["error"]["message"]
        r = c.post("/v1/encode", json={"images": []}, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401 and "wrong bearer token" in r.json()["error"]["message"]
        assert c.get("/v1/metadata").status_code == 401
        assert c.post("/v1/fetch", json={}).status_code == 401
    with client(auth_service, headers={"authorization": f"Bearer {AUTH_TOKEN}"}) as c:
        r = encode_json(c, [data], return_embeddings=True)
        assert r.status_code == 200, r.text
        assert_close(embedding_of(r.json()["images"][0]), reference_rows(auth_service.checkpoint, data))


def test_replicas_share_entries_through_redis(request, redis_server, tiny_checkpoint):
    from tests.support.service import RunningService, make_settings

    ckpt = tiny_checkpoint("qwen2_5_vl")
    a, b = (RunningService(make_settings(ckpt, "--redis-url", redis_server.url, grpc=False), ckpt) for _ in "ab")
    request.addfinalizer(a.close)
    request.addfinalizer(b.close)
    data = image_bytes(80, 60, 31337)
    with client(a) as ca:
        info = encode_json(ca, [data], wait=True).json()["images"][0]
    a.call(a.core.replicas.redis.flush)  # the write-behind has landed in Redis
    before = images_encoded(b)

    async def store_stats():  # on b's loop: the store is not thread-safe
        return b.core.replicas.stats()

    with client(b) as cb:  # replica b never saw the image: Redis says a has it, and b fetches those rows there
        r = cb.post("/v1/fetch", json={"items": [{"id": info["id"], "offset": 2}], "start": 0, "end": 6})
        assert r.status_code == 200, r.text
        header, rows = wire.decode_http(r.content)
        assert header.segments[0].row_start == 0 and rows.shape[0] == 4
        assert_close(rows, reference_rows(a.checkpoint, data)[:4])
        stats = b.call(store_stats)
        assert stats["redis_located"] == 1 and stats["redis_hits"] == 0  # only where they are: no rows in Redis
        assert b.sample("encoder_cache_hits_total", {"tier": "peer"}) == 1
        again = encode_json(cb, [data], wait=True).json()["images"][0]
        assert again["id"] == info["id"] and again["cached"] is True
    assert images_encoded(b) == before


def test_url_images_only_from_allowed_hosts(request, tiny_checkpoint):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.support.service import RunningService, make_settings

    data = image_bytes(70, 50, 2024)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            routes = {"/img.png": (200, data, {}), "/big.png": (200, b"\0" * (2 << 20), {}),
                      "/hop": (302, b"", {"Location": "/img.png"}),
                      "/away": (302, b"", {"Location": "http://elsewhere.invalid/img.png"})}
            status, body, headers = routes.get(self.path, (404, b"", {}))
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    request.addfinalizer(http.shutdown)
    base = f"http://127.0.0.1:{http.server_address[1]}"
    ckpt = tiny_checkpoint("qwen2_5_vl")
    svc = RunningService(make_settings(ckpt, "--allow-url-hosts", "127.0.0.1", grpc=False), ckpt)
    request.addfinalizer(svc.close)
    with client(svc) as c:
        r = c.post("/v1/encode", json={"images": [{"url": f"{base}/hop"}], "return_embeddings": True})
        assert r.status_code == 200, r.text
        assert_close(embedding_of(r.json()["images"][0]), reference_rows(svc.checkpoint, data))
        for path, needle in (("/away", "another host"), ("/big.png", "over the limit"), ("/nope", "HTTP 404")):
            r = c.post("/v1/encode", json={"images": [{"url": base + path}]})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        r = c.post("/v1/encode", json={"images": [{"url": "http://localhost:1/a.png"}]})
        assert r.status_code == 400 and "not in --allow-url-hosts" in r.json()["error"]["message"]


def test_pins_full_is_429_and_pins_that_can_never_fit_are_400(request, tiny_checkpoint):
    from encoder_service import errors
    from encoder_service.client import EncoderClient
    from tests.support.service import RunningService, make_settings

    ckpt = tiny_checkpoint("qwen2_5_vl")
    svc = RunningService(make_settings(ckpt, "--max-pinned-bytes", "1KiB"), ckpt)
    request.addfinalizer(svc.close)
    with client(svc) as c:
        first = encode_json(c, [image_bytes(64, 64, 55)])  # 4 tokens x 48 x 4 bytes = 768 B: fits
        assert first.status_code == 200, first.text
        # 768 B more fits once the first pin ends: 429, retry later.
        r = encode_json(c, [image_bytes(64, 64, 56)])
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        assert "max-pinned-bytes" in r.json()["error"]["message"]
        # 3072 B can never be pinned under 1 KiB, whatever else ends: 400 at once, naming image, size and flag.
        r = encode_json(c, [image_bytes(56, 56, 57), image_bytes(120, 120, 58)])
        assert r.status_code == 400 and "retry-after" not in r.headers, r.text
        assert r.json()["error"]["message"].startswith(
            "image 1: embedding bytes to pin is 3072, over the limit of 1024 (--max-pinned-bytes)")
        # Neither can two images that fit alone but not together.
        r = encode_json(c, [image_bytes(64, 64, 59), image_bytes(64, 64, 60)])
        assert r.status_code == 400 and "for the request's 2 images is 1536" in r.json()["error"]["message"]
        released = c.post("/v1/release", json={"ids": [first.json()["images"][0]["id"]]}).json()
        assert released == {"released": 1, "invalid": []}
        assert encode_json(c, [image_bytes(64, 64, 56)]).status_code == 200  # the 429 was worth retrying
    with EncoderClient.grpc(svc.grpc_address) as g:
        with pytest.raises(errors.InvalidInput, match=r"image 0: embedding bytes to pin is 3072.*--max-pinned-bytes"):
            g.encode([image_bytes(120, 120, 58)])


def test_a_fetch_gathering_rows_over_max_fetch_bytes_is_400(request, tiny_checkpoint):
    """One id placed many times in a chunk makes the server gather its rows that many times: bounded by
    --max-fetch-bytes (400 naming it, on both transports), while one item's rows (no copy) and a fetch under
    the bound are served."""
    from encoder_service import errors
    from encoder_service.client import EncoderClient
    from tests.support.service import RunningService, make_settings

    ckpt = tiny_checkpoint("qwen2_5_vl")
    svc = RunningService(make_settings(ckpt, "--max-fetch-bytes", "2KiB"), ckpt)
    request.addfinalizer(svc.close)
    with client(svc) as c:
        info = encode_json(c, [image_bytes(64, 64, 61)], wait=True).json()["images"][0]
        n, iid = info["num_tokens"], info["id"]  # 4 rows x 48 x 4 bytes = 768 B
        items = [{"id": iid, "offset": k * n} for k in range(3)]
        assert c.post("/v1/fetch", json={"items": items[:2], "start": 0, "end": 2 * n}).status_code == 200
        r = c.post("/v1/fetch", json={"items": items, "start": 0, "end": 3 * n})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "bytes of rows the fetch gathers is 2304, over the limit of 2048 (--max-fetch-bytes)"), r.text
        assert_still_serving(c)
    with EncoderClient.grpc(svc.grpc_address) as g:
        with pytest.raises(errors.InvalidInput, match="--max-fetch-bytes"):
            g.fetch([(iid, k * n) for k in range(3)], 0, 3 * n)


def test_wait_timeout_is_504_and_the_encode_goes_on(service):
    data = image_bytes(110, 70, 777)
    with client(service) as c:
        r = encode_json(c, [data], wait=True, timeout_s=1e-6)
        assert r.status_code == 504 and "timeout_s" in r.json()["error"]["message"], r.text
        info = encode_json(c, [data]).json()["images"][0]
        r = c.post("/v1/fetch", json={"items": [{"id": info["id"], "offset": 0}], "start": 0,
                                      "end": info["num_tokens"], "timeout_s": 20})
        assert r.status_code == 200
        assert_close(wire.decode_http(r.content)[1], reference_rows(service.checkpoint, data))


def test_timeout_s_zero_answers_with_cached_rows_at_once(service):
    data = image_bytes(90, 50, 778)
    with client(service) as c:
        r = encode_json(c, [data], wait=True, timeout_s=0)  # not cached: not ready, and 0 means don't wait
        assert r.status_code == 504 and "timeout_s=0 (don't wait)" in r.json()["error"]["message"], r.text
        info = encode_json(c, [data], wait=True, timeout_s=20).json()["images"][0]  # the encode went on
        r = encode_json(c, [data], return_embeddings=True, timeout_s=0)
        assert r.status_code == 200 and r.json()["images"][0]["cached"], r.text
        assert_close(embedding_of(r.json()["images"][0]), reference_rows(service.checkpoint, data))
        r = c.post("/v1/fetch", json={"items": [{"id": info["id"], "offset": 0}], "start": 0,
                                      "end": info["num_tokens"], "timeout_s": 0})
        assert r.status_code == 200 and wire.decode_http(r.content)[0].num_rows == info["num_tokens"], r.text
        r = c.post("/v1/encode?wait=true&timeout_s=-1", content=data, headers={"content-type": "image/png"})
        assert r.status_code == 400 and "timeout_s must be" in r.json()["error"]["message"], r.text


def test_a_client_gone_mid_upload_is_cancelled_not_an_error(service, caplog):
    def cancelled() -> float:
        labels = {"transport": "http", "method": "encode", "outcome": "cancelled"}
        return service.sample("encoder_requests_total", labels)

    caplog.set_level(logging.DEBUG)
    before = cancelled()
    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    for ctype in ("application/octet-stream", "application/json", "multipart/form-data; boundary=xyz"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST /v1/encode HTTP/1.1\r\nHost: t\r\nContent-Type: {ctype}\r\n"
                      "Content-Length: 100000\r\n\r\n".encode() + b"--xyz\r\n" + b"a" * 1000)
            time.sleep(0.2)  # the server reads the body; then the client goes away with 98% of it unsent
    # The server learns of it asynchronously.
    wait_for(lambda: cancelled() - before >= 3, "the 3 uploads cancelled", 10, poll_s=0.05)
    assert cancelled() - before == 3
    assert not [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r for r in caplog.records if r.name == "encoder_service.api.http" and "disconnected" in r.getMessage()]
    with client(service) as c:
        assert_still_serving(c)


def test_a_bug_is_500_internal_counted_and_logged_once(service, monkeypatch, caplog):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    def internal() -> float:
        labels = {"transport": "http", "method": "encode", "outcome": "internal"}
        return service.sample("encoder_requests_total", labels)

    monkeypatch.setattr(service.core, "encode", broken)
    before = internal()
    with client(service) as c:
        r = encode_json(c, [image_bytes(32, 32, 1)])
    assert r.status_code == 500 and r.json() == {"error": {"kind": "internal", "message": "internal error"}}
    assert internal() - before == 1
    logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert [rec.name for rec in logged] == ["encoder_service.api.http"] and logged[0].exc_info
    assert logged[0].request_id == r.headers["x-request-id"]  # the log line names the request it was for
