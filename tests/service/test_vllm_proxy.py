"""`encoder-service vllm-proxy` (integrations/vllm/proxy.py) in process, against the real service, with a
stand-in vLLM app: the rewrite, error answers, pins released when vLLM refuses, and the documented commands
(docs/vllm.md) parse as they are. The real HTTP round trip, streaming chunk by chunk and vLLM's own parsing of
what the proxy forwards are in tests/engines/vllm/test_vllm_chat_front.py.
"""

from __future__ import annotations

import argparse
import base64
import json

import grpc
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from encoder_service import errors
from encoder_service import settings as settings_module
from encoder_service.client.errors import remote_error
from encoder_service.integrations.vllm import ec_transfer_config, proxy
from encoder_service.protocol.errors import KINDS
from encoder_service.settings import ProxySettings, Settings
from tests.support.encoder_process import ServiceProcess, encoder_service_argv
from tests.support.images import image_bytes as png
from tests.support.images import truncated_jpeg
from tests.support.ports import free_port
from tests.support.vllm_docs import DOC_TOKEN, DOC_URL, doc_ec_transfer_config, documented
from tests.support.vllm_stand_in import StandInVllm

pytestmark = pytest.mark.timeout(60)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


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
    for argv, env, match in [([], {}, "--encoder-url"), (["--encoder-url", "e:1", "--vllm-url", "http://v"], {}, "http"),
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
        proxy.image_parts({})


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
