"""`encoder-service vllm-proxy`: an OpenAI chat front end for a vLLM instance that runs EncoderServiceConnector.

    encoder-service vllm-proxy --encoder-url http://127.0.0.1:8000 --vllm-url http://127.0.0.1:8200 \
        --host 0.0.0.0 --port 8100 [--api-key KEY] [--auth-token TOKEN] [--vllm-api-key KEY]

With --api-key, every call but /health must carry `Authorization: Bearer KEY`, checked before the body is read,
so an unauthenticated caller never gets an image encoded (vLLM's own --api-key only sees the request after
the encode).

POST /v1/chat/completions: every `{"type": "image_url", "image_url": {"url": ...}}` part (a data: URL, or an
http(s) URL the encoder fetches itself: its --allow-url-hosts) goes to our `encode` (one call per chat
request, answered once the ViT has run: an image that fails to decode or encode is the caller's error
answer here, with our error's kind, message and status, before vLLM is called), and is replaced by the
metadata-only part vLLM's consumer takes

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]}, "uuid": "<our id>"}

and the request gets `ec_transfer_params = {"encoder_service": {"ids": [...]}}` (our ids in image order, for
requests whose identifier vLLM re-hashes: see connector.py). Then it is forwarded to `--vllm-url`; the answer
comes back as it is, a streamed one (`"stream": true`, server-sent events) chunk by chunk as vLLM sends it.
The connector releases the encode's pins when vLLM finishes the request; when vLLM refuses the request
outright (an HTTP error status), the proxy releases them itself.
GET /v1/models and /health are passed through (/health also asks the encoder's /health/ready over HTTP).

Every flag has an env twin, ENCODER_PROXY_<FLAG> (the flag wins): settings.py, PROXY_OPTIONS.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (`request: Request`,
# imported inside make_app) at definition time.
import base64
import binascii
import copy
import hmac
import logging
from typing import Sequence

from encoder_service import errors
from encoder_service.client import AsyncEncoderClient, ImageSource
from encoder_service.integrations.vllm import PARAMS_KEY
from encoder_service.protocol.errors import http_status
from encoder_service.settings import ProxySettings

log = logging.getLogger("encoder_service.vllm_proxy")

IMAGE_TYPES = ("image_url",)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "te",
               "trailer", "upgrade", "proxy-authenticate", "proxy-authorization"}


# ---- the rewrite ------------------------------------------------------------------------------------------
def image_parts(body: dict) -> list[dict]:
    """The request's image parts, in prompt order (messages in order, parts in order)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise errors.InvalidInput("a chat request needs a 'messages' list")
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_TYPES]
    return parts


def image_source(part: dict) -> ImageSource:
    """An image part's bytes (data: URL, base64) or its http(s) URL, for our encode."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise errors.InvalidInput("an image_url part without a url")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise errors.InvalidInput("data: image URLs must be base64")
        try:
            return ImageSource(data=base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise errors.InvalidInput("an image data: URL is not valid base64") from None
    if url.startswith(("http://", "https://")):
        return ImageSource(url=url)
    raise errors.InvalidInput(f"image url must be a data: or http(s) URL, got {url[:40]!r}")


def embeds_part(info) -> dict:
    """The metadata-only part vLLM's EC consumer takes for one encoded image (`info`: our ImageInfo)."""
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": list(info.grid_thw)}, "uuid": info.id}


def rewrite(body: dict, infos: Sequence) -> dict:
    """A copy of `body` with its image parts (image_parts order) replaced by `embeds_part(infos[k])`, and our
    ids in `ec_transfer_params`."""
    out = copy.deepcopy(body)
    parts = image_parts(out)
    if len(parts) != len(infos):
        raise ValueError(f"{len(parts)} image parts, {len(infos)} encoded images")
    for part, info in zip(parts, infos):
        part.clear()
        part.update(embeds_part(info))
    if infos:
        params = dict(out.get("ec_transfer_params") or {})
        params[PARAMS_KEY] = {"ids": [i.id for i in infos]}
        out["ec_transfer_params"] = params
    return out


# ---- the app ----------------------------------------------------------------------------------------------
def _error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _encoder_error(exc: errors.EncoderServiceError):
    """A failed encode as the caller's answer, in OpenAI's error shape: the status the encoder answered
    (over HTTP; else the status of the error's kind), our message, and the kind as the error's type."""
    status = exc.status if isinstance(getattr(exc, "status", None), int) else http_status(exc)
    return _error(status, f"encoder service: {exc.message}", exc.kind)


def _caller_refused(authorization: str | None, api_key: bytes | None) -> str | None:
    """Why a caller is refused (None: it is served): without `Authorization: Bearer <the proxy's --api-key>`."""
    if api_key is None:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return "missing API key: send 'Authorization: Bearer <key>'"
    return None if hmac.compare_digest(given.strip().encode(), api_key) else "wrong API key"


def _upstream_headers(request, settings: ProxySettings) -> dict:
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    if settings.vllm_api_key:
        headers["authorization"] = f"Bearer {settings.vllm_api_key}"
    elif "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    if "x-request-id" in request.headers:
        headers["x-request-id"] = request.headers["x-request-id"]
    return headers


def _passed_headers(response) -> dict:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP}


def _encoder_client(settings: ProxySettings) -> AsyncEncoderClient:
    if settings.encoder_url.startswith("grpc://"):
        return AsyncEncoderClient.grpc(settings.encoder_url.removeprefix("grpc://"), token=settings.auth_token,
                                       timeout=settings.timeout_s)
    return AsyncEncoderClient.http(settings.encoder_url, token=settings.auth_token, timeout=settings.timeout_s)


def make_app(settings: ProxySettings, *, encoder=None, upstream=None):
    """The proxy's FastAPI app. `encoder` (an AsyncEncoderClient) and `upstream` (an httpx.AsyncClient for
    vLLM) are built from `settings` when not given; the app closes what it built."""
    import contextlib

    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from starlette.background import BackgroundTask

    own = []
    clients = {"encoder": encoder}

    def the_encoder() -> AsyncEncoderClient:
        """The encoder's client, built on first use when not given: on the server's loop, which uvicorn starts
        after make_app (a gRPC channel works only on the loop it was made on)."""
        if clients["encoder"] is None:
            clients["encoder"] = _encoder_client(settings)
            own.append(clients["encoder"].close)
        return clients["encoder"]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            for closer in own:
                await closer()

    app = FastAPI(title="encoder-service vllm-proxy", lifespan=lifespan)
    if upstream is None:
        upstream = httpx.AsyncClient(base_url=settings.vllm_url, timeout=httpx.Timeout(settings.timeout_s,
                                                                                      connect=10.0))
        own.append(upstream.aclose)
    api_key = settings.api_key.encode() if settings.api_key else None

    def refused(request: Request):
        """A 401 answer unless the caller sent the proxy's --api-key (None: let it through)."""
        why = _caller_refused(request.headers.get("authorization"), api_key)
        if why is None:
            return None
        answer = _error(401, why, "authentication_error")
        answer.headers["www-authenticate"] = "Bearer"
        return answer

    async def release(ids: list[str]) -> None:
        try:
            await the_encoder().release(ids)
        except Exception as exc:  # noqa: BLE001 - pins end at their lease anyway
            log.warning("release of %d ids failed: %s", len(ids), exc)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        ids: list[str] = []
        try:
            parts = image_parts(body)
            if parts:
                # wait=True: the answer comes once the ViT has run, so an image that fails to decode or encode
                # fails here, with our reason, and never reaches vLLM (whose front end would answer a failed
                # item with a bare 500: docs/vllm.md). What it costs: vLLM's own request handling no longer
                # overlaps the ViT; the connector's fetch waited for the ViT anyway.
                infos = await the_encoder().encode([image_source(p) for p in parts], wait=True)
                ids = sorted({i.id for i in infos})
                body = rewrite(body, infos)
        except errors.EncoderServiceError as exc:
            return _encoder_error(exc)
        upstream_request = upstream.build_request("POST", "/v1/chat/completions", json=body,
                                                  headers=_upstream_headers(request, settings))
        try:
            response = await upstream.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            if ids:
                await release(ids)
            return _error(502, f"vLLM at {settings.vllm_url} unreachable: {type(exc).__name__}: {exc}",
                          "upstream_error")
        if response.status_code >= 400 and ids:  # refused before the engine: no request_finished will release
            await release(ids)
        if "text/event-stream" in response.headers.get("content-type", ""):
            return StreamingResponse(response.aiter_raw(), status_code=response.status_code,
                                     headers=_passed_headers(response), background=BackgroundTask(response.aclose))
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return Response(content, status_code=response.status_code, headers=_passed_headers(response))

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        try:
            response = await upstream.get("/v1/models", headers=_upstream_headers(request, settings))
        except httpx.HTTPError as exc:
            return _error(502, f"vLLM unreachable: {exc}", "upstream_error")
        return Response(response.content, status_code=response.status_code, headers=_passed_headers(response))

    @app.get("/health")
    async def health():
        status = {}
        try:
            status["vllm"] = (await upstream.get("/health")).status_code == 200
        except httpx.HTTPError:
            status["vllm"] = False
        if settings.encoder_url.startswith("http"):
            try:
                async with httpx.AsyncClient(timeout=5.0) as probe:
                    status["encoder"] = (await probe.get(settings.encoder_url + "/health/ready")).status_code == 200
            except httpx.HTTPError:
                status["encoder"] = False
        from fastapi.responses import JSONResponse

        return JSONResponse(status, status_code=200 if all(status.values()) else 503)

    return app


def serve(settings: ProxySettings) -> None:
    import uvicorn

    if settings.api_key is None and settings.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("vllm-proxy listens on %s without --api-key: any caller that reaches it gets its images "
                    "encoded", settings.host)

    uvicorn.run(make_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=5)
