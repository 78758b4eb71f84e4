"""`encoder-service vllm-proxy` (integrations/vllm/proxy.py) in process, against the real service, with a
stand-in vLLM app: the rewrite, error answers, pins released when vLLM refuses, and the documented commands
(docs/vllm.md) parse as they are. The real HTTP round trip, streaming chunk by chunk and vLLM's own parsing of
what the proxy forwards are in tests/engines/vllm/test_vllm_chat_front.py.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re

import grpc
import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from encoder_service import errors
from encoder_service import settings as settings_module
from encoder_service.client.types import VideoInfo
from encoder_service.integrations.vllm import ec_transfer_config, proxy
from encoder_service.protocol.errors import KINDS, remote_error
from encoder_service.settings import ProxySettings, Settings
from tests.support.clients import sync_client
from tests.support.encoder_process import ServiceProcess, encoder_service_argv
from tests.support.images import data_url
from tests.support.images import image_bytes as png
from tests.support.images import truncated_jpeg
from tests.support.ports import free_port
from tests.support.video_cases import frame_images, make_clip
from tests.support.vllm_docs import DOC_TOKEN, DOC_URL, doc_ec_transfer_config, documented
from tests.support.vllm_stand_in import StandInVllm

pytestmark = pytest.mark.timeout(60)

CLIP = make_clip("mp4_h264", frames=5, width=128, height=96)  # 5 frames: 3 frame groups, the last padded



def body_with(*urls: str, text: str = "hi", **extra) -> dict:
    return {"model": "m", **extra, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                     {"type": "text", "text": text}]}]}


def test_documented_commands():
    assert doc_ec_transfer_config() == ec_transfer_config(DOC_URL, auth_token=DOC_TOKEN)
    serve = documented("encoder").argv
    assert serve[:2] == ["encoder-service", "serve"]
    settings = Settings.from_args(serve[2:], env={})
    assert settings.server.shm_fetch and settings.server.auth_token == DOC_TOKEN
    assert f"http://{settings.server.host}:{settings.server.http_port}" == DOC_URL
    vllm = documented("vllm")
    assert vllm.argv[:2] == ["vllm", "serve"] and vllm.env == {"CUDA_VISIBLE_DEVICES": "1"}
    argv = documented("proxy").argv
    assert argv[:2] == ["encoder-service", "vllm-proxy"]
    parser = argparse.ArgumentParser()
    settings_module.add_proxy_arguments(parser)
    s = settings_module.resolve_proxy(parser.parse_args(argv[2:]), env={})
    assert (s.encoder_url, s.auth_token) == (DOC_URL, DOC_TOKEN)
    assert s.host == "0.0.0.0" and s.api_key  # listening beyond loopback: callers must bring a key
    assert s.vllm_url == f"http://127.0.0.1:{vllm.value('--port')}"
    for name in ("cpu-aggregated", "cpu-consumer"):  # the vllm-e2e tier's servers
        cpu = documented(name)
        assert cpu.argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], cpu.argv
    assert json.loads(documented("cpu-consumer").value("--ec-transfer-config")) == \
        ec_transfer_config(DOC_URL, auth_token=DOC_TOKEN)


def test_settings():
    parser = argparse.ArgumentParser()
    settings_module.add_proxy_arguments(parser)
    s = settings_module.resolve_proxy(parser.parse_args(["--vllm-url", "http://v:1/"]),
                            env={"ENCODER_PROXY_ENCODER_URL": "grpc://e:2", "ENCODER_PROXY_PORT": "9"})
    assert (s.encoder_url, s.vllm_url, s.port, s.host) == ("grpc://e:2", "http://v:1", 9, "127.0.0.1")
    for argv, env, match in [([], {}, "--encoder-url"),
                             (["--encoder-url", "e:1", "--vllm-url", "http://v"], {}, "http"),
                             (["--encoder-url", "http://e", "--vllm-url", "grpc://v"], {}, "HTTP"),
                             (["--encoder-url", "http://e", "--vllm-url", "http://v", "--port", "0"], {}, "port")]:
        with pytest.raises(ValueError, match=match):
            settings_module.resolve_proxy(parser.parse_args(argv), env)


def test_rewrite():
    infos = [type("Info", (), {"id": i, "grid_thw": (1, 4, 2 * k + 2)})() for k, i in enumerate("ab")]
    body = body_with(data_url(b"x"), "https://h/p.png", ec_transfer_params={"other": 1})
    out = proxy.rewrite(body, infos)
    assert out["messages"][1]["content"][:2] == [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 2]}, "uuid": "a"},
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "b"}]
    assert out["ec_transfer_params"] == {"other": 1, "encoder_service": {"ids": ["a", "b"]}}
    assert body["messages"][1]["content"][0]["type"] == "image_url"  # the caller's body is left alone
    assert proxy.image_source(body["messages"][1]["content"][1]).url == "https://h/p.png"
    assert proxy.image_source({"type": "image_url", "image_url": data_url(b"raw")}).data == b"raw"
    for bad in [{"image_url": {}}, {"image_url": {"url": "data:image/png,xx"}}, {"image_url": {"url": "file:///x"}},
                {"image_url": {"url": "data:image/png;base64,@@"}}]:
        with pytest.raises(errors.InvalidInput):
            proxy.image_source(bad)
    with pytest.raises(errors.InvalidInput, match="messages"):
        proxy.media_parts({})


def video_url(data: bytes | list[bytes], media_type: str = "video/mp4") -> dict:
    """A video_url part: a container file, or frames as vLLM's JPEG sequence (comma-separated base64)."""
    if isinstance(data, list):
        payload, media_type = ",".join(base64.b64encode(f).decode() for f in data), "video/jpeg"
    else:
        payload = base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": f"data:{media_type};base64,{payload}"}}


def chat_with(*parts: dict, **extra) -> dict:
    return {"model": "m", **extra, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}


def npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def video_info(family: str, **fields) -> VideoInfo:
    qwen3 = family == "qwen3_vl"
    return VideoInfo(**{"id": "v:u:a", "video_grid_thw": (3, 4, 6), "num_tokens": 18, "tokens_per_group": 6,
                        "num_frames": 6, "sampled_fps": 30.0, "second_per_grid_t": None if qwen3 else 2 / 30,
                        "group_timestamps": (0.25, 1.0, 1.75) if qwen3 else None, "row_width": 48,
                        "hidden_size": 48, "layout": "main", "dtype": "float32", "cached": False, **fields})


def test_rewrite_videos():
    """A video part becomes a video_embeds part with what the family's vLLM model needs besides the grid; the
    video options are taken out of the request; the ids follow the prompt's order, images and videos alike."""
    image = type("Info", (), {"id": "i", "grid_thw": (1, 4, 4)})()
    body = chat_with(video_url(b"v"), {"type": "image_url", "image_url": {"url": data_url(b"x")}},
                     mm_processor_kwargs={"fps": 1, "num_frames": 8, "do_sample_frames": True, "max_pixels": 9},
                     media_io_kwargs={"video": {"fps": 3}})
    assert proxy.video_options(body) == ({"fps": 1, "num_frames": 8, "sample_frames": True}, 3)
    assert proxy.video_options(chat_with()) == ({}, proxy.JPEG_SEQUENCE_FPS)
    wanted = {"qwen2_vl": set(), "qwen2_5_vl": {"second_per_grid_ts"}, "qwen3_vl": {"timestamps"}}
    for family, extra in wanted.items():
        out = proxy.rewrite(body, [video_info(family), image], family)
        video, image_part = out["messages"][0]["content"][:2]
        assert video["type"] == "video_embeds" and video["uuid"] == "v:u:a" and image_part["uuid"] == "i"
        assert video["video_embeds"].keys() == {"video_grid_thw"} | extra
        assert video["video_embeds"]["video_grid_thw"] == [3, 4, 6]
        assert out["ec_transfer_params"] == {"encoder_service": {"ids": ["v:u:a", "i"]}}
        assert out["mm_processor_kwargs"] == {"max_pixels": 9} and "media_io_kwargs" not in out
    seconds = npy(proxy.rewrite(body, [video_info("qwen2_5_vl"), image], "qwen2_5_vl")["messages"][0]["content"][0]
                  ["video_embeds"]["second_per_grid_ts"])
    assert seconds.shape == () and seconds.dtype == np.float32 and seconds == np.float32(2 / 30)
    assert proxy.rewrite(body, [video_info("qwen3_vl"), image], "qwen3_vl")["messages"][0]["content"][0][
        "video_embeds"]["timestamps"] == [0.25, 1.0, 1.75]
    with pytest.raises(errors.InvalidInput, match="videos of qwen2_vl, qwen2_5_vl, qwen3_vl only; the encoder serves"):
        proxy.rewrite(body, [video_info("qwen3_vl"), image], "llava")
    options = {"fps": 2}
    assert proxy.video_source(video_url(b"mp4"), options, 1).data == b"mp4"
    frames = proxy.video_source(video_url([b"a", b"b"]), options, 3)
    assert (frames.frames, frames.frames_fps, frames.fps) == ((b"a", b"b"), 3, 2)
    assert proxy.video_source({"video_url": {"url": "https://h/v.mp4"}}, {}, 1).url == "https://h/v.mp4"
    for bad in [{"video_url": {}}, {"video_url": {"url": "data:video/mp4,xx"}}, {"video_url": {"url": "file:///v"}},
                {"video_url": {"url": "data:video/mp4;base64,@@"}},
                {"video_url": {"url": "data:video/jpeg;base64,AA==,@@"}}]:
        with pytest.raises(errors.InvalidInput):
            proxy.video_source(bad, {}, 1)
    with pytest.raises(errors.InvalidInput, match="mm_processor_kwargs must be an object"):
        proxy.video_options(chat_with(mm_processor_kwargs=[1]))


def option_name(kwargs: dict) -> str:
    """The encode option a video kwarg of the request becomes (its name in the proxy's error)."""
    (name,) = kwargs
    return proxy.VIDEO_KWARGS[name]


def stand_in_vllm(seen: list) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append((body, request.headers.get("authorization")))
        if body["messages"][-1]["content"][-1]["text"] == "refuse":
            return JSONResponse({"error": {"message": "refused"}}, status_code=400)
        if body.get("stream"):
            async def events():
                for k in range(3):
                    yield f"data: {k}\n\n".encode()
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"message": {"content": "ok"}}]}

    return app


@pytest.fixture
def proxied(service):
    seen = []
    settings = ProxySettings(encoder_url=service.url, vllm_url="http://vllm", vllm_api_key="k")
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(stand_in_vllm(seen)), base_url="http://vllm")
    app = proxy.make_app(settings, upstream=upstream)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy"), seen


async def test_proxy_forwards_rewritten(proxied, service):
    client, seen = proxied
    images = [png(224, 168, 501), png(84, 140, 502)]
    r = await client.post("/v1/chat/completions", json=body_with(*map(data_url, images)))
    assert r.status_code == 200 and r.json() == {"choices": [{"message": {"content": "ok"}}]}
    forwarded, auth = seen[-1]
    parts = forwarded["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["image_embeds", "image_embeds", "text"] and auth == "Bearer k"
    ids = [p["uuid"] for p in parts[:2]]
    assert forwarded["ec_transfer_params"] == {"encoder_service": {"ids": ids}}
    assert all(service.pinned(i) for i in ids)  # pinned until vLLM's connector releases them
    r = await client.post("/v1/chat/completions", json=body_with(data_url(images[0]), stream=True))
    assert r.status_code == 200 and r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    plain = body_with(text="no images")
    assert (await client.post("/v1/chat/completions", json=plain)).status_code == 200 and seen[-1][0] == plain


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
async def test_proxy_forwards_videos(service, service_qwen3, family):
    """Videos (an MP4 file and a JPEG sequence) and an image in one chat request: each is encoded (the same ids
    as our client's encode of the same item with the same options) and forwarded as an embeds part with the
    family's metadata; the video options are taken out; every item stays pinned for the connector."""
    svc = service if family == "qwen2_5_vl" else service_qwen3
    seen = []
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(stand_in_vllm(seen)), base_url="http://vllm")
    app = proxy.make_app(ProxySettings(encoder_url=svc.url, vllm_url="http://vllm"), upstream=upstream)
    image, frames = png(112, 84, 530), frame_images(3, height=64, width=96, fmt="JPEG")
    body = chat_with(video_url(CLIP), {"type": "image_url", "image_url": {"url": data_url(image)}},
                     video_url(frames), mm_processor_kwargs={"do_sample_frames": False},
                     media_io_kwargs={"video": {"fps": 4}})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    forwarded = seen[-1][0]
    with sync_client(svc, "http") as c:
        (clip,) = c.encode_videos([CLIP], sample_frames=False)
        (sequence,) = c.encode_videos([frames], sample_frames=False, frames_fps=4)
        (img,) = c.encode([image])
        c.release([clip.id, sequence.id, img.id])  # the pins of this encode; the proxy's stay
    clip_part, image_part, sequence_part = forwarded["messages"][0]["content"][:3]
    assert image_part == proxy.embeds_part(img)
    for part, info in [(clip_part, clip), (sequence_part, sequence)]:
        assert part["type"] == "video_embeds" and part["uuid"] == info.id
        meta = part["video_embeds"]
        assert meta["video_grid_thw"] == list(info.video_grid_thw)
        if family == "qwen3_vl":
            assert meta.keys() == {"video_grid_thw", "timestamps"} and meta["timestamps"] == list(info.group_timestamps)
        else:
            assert meta.keys() == {"video_grid_thw", "second_per_grid_ts"}
            assert npy(meta["second_per_grid_ts"]) == np.float32(info.second_per_grid_t)
    assert sequence.num_frames == 3 and sequence.sampled_fps == 4 and clip.num_frames == 5
    assert forwarded["ec_transfer_params"] == {"encoder_service": {"ids": [clip.id, img.id, sequence.id]}}
    assert "mm_processor_kwargs" not in forwarded and "media_io_kwargs" not in forwarded
    assert all(svc.pinned(i) for i in (img.id, clip.group_id(clip.num_groups - 1), sequence.group_id(1)))


@pytest.mark.parametrize("transport", ["http", "grpc"])
async def test_proxy_video_errors(service, transport):
    """A video that does not decode, or options of the wrong type, are the caller's 400 naming them; a body
    over --max-body-bytes is a 413; vLLM never sees the request, and the pins of the request's images that did
    encode are released."""
    seen = []
    url = service.url if transport == "http" else "grpc://" + service.grpc_address
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(stand_in_vllm(seen)), base_url="http://vllm")
    app = proxy.make_app(ProxySettings(encoder_url=url, vllm_url="http://vllm", max_body_bytes=1 << 20),
                         upstream=upstream)
    image = png(112, 84, 540)
    image_part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client:
        r = await client.post("/v1/chat/completions", json=chat_with(image_part, video_url(b"not a video")))
        error = r.json()["error"]
        assert (r.status_code, error["type"]) == (400, "invalid_input") and "video 0: " in error["message"], error
        r = await client.post("/v1/chat/completions", json=chat_with({"type": "video_url", "video_url": {
            "url": "file:///etc/passwd"}}))
        assert r.status_code == 400 and "data: or http(s) URL" in r.json()["error"]["message"]
        for kwargs in [{"fps": "two"}, {"num_frames": 1.5}, {"num_frames": 2**70}, {"do_sample_frames": 1}]:
            r = await client.post("/v1/chat/completions", json=chat_with(
                image_part, video_url(CLIP), mm_processor_kwargs=kwargs))
            error = r.json()["error"]
            assert (r.status_code, error["type"]) == (400, "invalid_input"), error
            assert f"video option {option_name(kwargs)}=" in error["message"], error
        r = await client.post("/v1/chat/completions", json=chat_with(video_url(b"x" * (1 << 20))))
        assert (r.status_code, r.json()["error"]["type"]) == (413, "payload_too_large"), r.text
        assert re.fullmatch(r"request body bytes \(Content-Length\) is \d+, over the limit of 1048576 "
                            r"\(--max-body-bytes\)", r.json()["error"]["message"]), r.text

        async def chunked():  # no Content-Length: counted while read
            for _ in range(5):
                yield b"x" * (256 << 10)

        r = await client.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["message"]) == (413, (
            "request body bytes (no Content-Length: counted while read) is at least 1310720, over the limit of "
            "1048576 (--max-body-bytes)")), r.text
    assert seen == []
    with sync_client(service, "http") as c:
        (img,) = c.encode([image])
        c.release([img.id])
    assert not service.pinned(img.id)


async def test_proxy_api_key(service):
    """With --api-key, a caller without the key is refused before its images reach the encoder."""
    seen, key = [], "client-key"
    settings = ProxySettings(encoder_url=service.url, vllm_url="http://vllm", api_key=key)
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(stand_in_vllm(seen)), base_url="http://vllm")
    app = proxy.make_app(settings, upstream=upstream)
    image = png(112, 84, 505)

    def encodes() -> float:
        return service.sample("encoder_requests_total", {"transport": "http", "method": "encode", "outcome": "ok"})

    before = encodes()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client:
        for headers in [{}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {key}"}]:
            r = await client.post("/v1/chat/completions", json=body_with(data_url(image)), headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "authentication_error"
            assert (await client.get("/v1/models", headers=headers)).status_code == 401
        assert seen == [] and encodes() == before  # nothing sent to the encoder, nothing forwarded
        r = await client.post("/v1/chat/completions", json=body_with(data_url(image)),
                              headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200 and seen[-1][1] == f"Bearer {key}"  # the caller's key goes on to vLLM
        assert encodes() == before + 1


async def test_proxy_errors(proxied, service):
    client, seen = proxied
    n = len(seen)
    r = await client.post("/v1/chat/completions", json=body_with(data_url(b"not an image")))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("encoder service:")
    assert (await client.post("/v1/chat/completions", content=b"{")).status_code == 400
    assert (await client.post("/v1/chat/completions", json=[1])).status_code == 400
    assert len(seen) == n
    image = png(140, 84, 503)
    r = await client.post("/v1/chat/completions", json=body_with(data_url(image), text="refuse"))
    assert r.status_code == 400 and r.json() == {"error": {"message": "refused"}}
    assert not service.pinned(seen[-1][0]["messages"][1]["content"][0]["uuid"])  # the proxy released it
    down = proxy.make_app(ProxySettings(encoder_url=service.url, vllm_url="http://127.0.0.1:9"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(down), base_url="http://proxy") as c:
        r = await c.post("/v1/chat/completions", json=body_with(data_url(png(56, 56, 504))))
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]


@pytest.mark.parametrize("transport", ["http", "grpc"])
async def test_failed_encode_is_answered_before_vllm(service, transport):
    """An image whose header reads fine but whose decode fails (on the encoder's CPU thread, after encode has
    sized it) is the caller's 400 with our kind and message, and vLLM never sees the request; so is a
    malformed image. An encoder that is down is a 503 of kind unavailable."""
    seen = []
    url = service.url if transport == "http" else "grpc://" + service.grpc_address
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(stand_in_vllm(seen)), base_url="http://vllm")
    app = proxy.make_app(ProxySettings(encoder_url=url, vllm_url="http://vllm"), upstream=upstream)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client:
        for image, why in [(truncated_jpeg(511), "decode"), (b"not an image", "not an image")]:
            r = await client.post("/v1/chat/completions", json=body_with(data_url(png(56, 56, 510)), data_url(image)))
            error = r.json()["error"]
            assert (r.status_code, error["type"], error["code"]) == (400, "invalid_input", 400), error
            assert error["message"].startswith("encoder service: image 1: ") and why in error["message"], error
        assert seen == []
    down_url = f"http://127.0.0.1:{free_port()}" if transport == "http" else f"grpc://127.0.0.1:{free_port()}"
    down = proxy.make_app(ProxySettings(encoder_url=down_url, vllm_url="http://vllm", timeout_s=10), upstream=upstream)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(down), base_url="http://proxy") as client:
        r = await client.post("/v1/chat/completions", json=body_with(data_url(png(56, 56, 512))))
        assert (r.status_code, r.json()["error"]["type"]) == (503, "unavailable"), r.json()
    assert seen == []


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_served_proxy_encodes_over_either_transport(service, tmp_path, transport):
    """`encoder-service vllm-proxy` as run (its own process, uvicorn's loop) with an HTTP or a gRPC encoder URL
    forwards the rewritten request (a gRPC client made before uvicorn's loop starts fails every encode)."""
    vllm = StandInVllm()
    port = free_port()
    url = service.url if transport == "http" else "grpc://" + service.grpc_address
    argv = encoder_service_argv("vllm-proxy", "--encoder-url", url, "--vllm-url", vllm.url, "--port", str(port),
                                "--log-level", "warning")
    try:
        with ServiceProcess(argv, f"http://127.0.0.1:{port}/health", tmp_path / "proxy.log", name="vllm-proxy") as p:
            p.wait_ready(60)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body_with(data_url(png(56, 84, 520))),
                           timeout=60)
            assert r.status_code == 200, (r.text, p.log_tail())
        assert vllm.bodies[-1]["messages"][1]["content"][0]["type"] == "image_embeds"
    finally:
        vllm.shutdown()


def test_encoder_errors_keep_their_status_and_kind():
    """Any error kind the encoder answers reaches the proxy's caller with its status (protocol/errors.py's
    table, e.g. 409 for an id conflict) and kind: as the encoder answered over HTTP; over gRPC by the kind the
    client raised (which folds the HTTP body's own kinds, 413 and 415, into invalid_input)."""
    for kind, known in KINDS.items():
        for status in (known.http_status, getattr(grpc.StatusCode, known.grpc_code)):
            exc = remote_error(kind, f"{kind} here", status)
            answer = proxy._encoder_error(exc)
            want = known.http_status if isinstance(status, int) else KINDS[exc.kind].http_status
            assert answer.status_code == want, (kind, status)
            body = json.loads(answer.body)["error"]
            assert body["type"] == exc.kind and body["message"].startswith(f"encoder service: {kind} here")
    conflict = remote_error("conflict", "id u:a names other bytes", grpc.StatusCode.ALREADY_EXISTS)
    assert proxy._encoder_error(conflict).status_code == 409
