"""`encoder-service vllm-proxy`: an OpenAI chat front end for a vLLM instance that runs EncoderServiceConnector.

    encoder-service vllm-proxy --encoder-url http://127.0.0.1:8000 --vllm-url http://127.0.0.1:8200 \
        --host 0.0.0.0 --port 8100 [--api-key KEY] [--auth-token TOKEN] [--vllm-api-key KEY]

With --api-key, every call but /health must carry `Authorization: Bearer KEY`, checked before the body is read,
so an unauthenticated caller never gets an image encoded (vLLM's own --api-key only sees the request after
the encode).

POST /v1/chat/completions: every `{"type": "image_url", "image_url": {"url": ...}}` part (a data: URL, or an
http(s) URL the encoder fetches itself: its --allow-url-hosts) and every `{"type": "video_url", "video_url":
{"url": ...}}` part (a container file as a data: URL, vLLM's JPEG sequence `data:video/jpeg;base64,<frame>,
<frame>,...`, or an http(s) URL) goes to our `encode` (one call for the images and one for the videos of a chat
request, answered once the ViT has run: an item that fails to decode or encode is the caller's error answer
here, with our error's kind, message and status, before vLLM is called), and is replaced by the
metadata-only part vLLM's consumer takes

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]}, "uuid": "<our id>"}
    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [t, h, w], ...}, "uuid": "<our video id>"}

with what vLLM needs beside the grid to build a video's prompt and M-RoPE positions (`video_metadata`). The
request gets `ec_transfer_params = {"encoder_service": {"ids": [...]}}` (our ids in prompt order, for requests
whose identifier vLLM re-hashes: see connector.py). A video's options are the request's `mm_processor_kwargs`
`fps`, `num_frames`, `do_sample_frames` (transformers' video processor's), and a JPEG sequence's frame rate its
`media_io_kwargs["video"]["fps"]` (1 when not given, as vLLM assumes); the proxy takes them out of the request
(vLLM sees no video, and would refuse or re-hash for them). Then it is forwarded to `--vllm-url`; the answer
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
import io
import json
import logging
from typing import Sequence

import numpy as np

from encoder_service import errors
from encoder_service.client import AsyncEncoderClient, ImageSource, VideoSource
from encoder_service.integrations.vllm import PARAMS_KEY
from encoder_service.protocol.errors import http_status
from encoder_service.protocol.video_info import VideoInfo
from encoder_service.settings import ProxySettings

log = logging.getLogger("encoder_service.vllm_proxy")

IMAGE_TYPES, VIDEO_TYPES = ("image_url",), ("video_url",)
# A video's options in mm_processor_kwargs: transformers' video processor's names -> our encode's.
VIDEO_KWARGS = {"fps": "fps", "num_frames": "num_frames", "do_sample_frames": "sample_frames"}
JPEG_SEQUENCE_FPS = 1.0  # vLLM's frame rate of a data:video/jpeg sequence without media_io_kwargs
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "te",
               "trailer", "upgrade", "proxy-authenticate", "proxy-authorization"}


# ---- the rewrite ------------------------------------------------------------------------------------------
def media_parts(body: dict) -> list[dict]:
    """The request's image and video parts, in prompt order (messages in order, parts in order)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise errors.InvalidInput("a chat request needs a 'messages' list")
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_TYPES + VIDEO_TYPES]
    return parts


def is_video(part: dict) -> bool:
    return part.get("type") in VIDEO_TYPES


def _url(part: dict, key: str) -> str:
    spec = part.get(key)
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise errors.InvalidInput(f"a {key} part without a url")
    return url


def _base64(payload: str, what: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise errors.InvalidInput(f"{what} data: URL is not valid base64") from None


def _data_url(url: str, what: str) -> tuple[str, str]:
    """(media type, base64 payload) of a data: URL."""
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise errors.InvalidInput(f"data: {what} URLs must be base64")
    return header.removeprefix("data:").split(";")[0].lower(), payload


def image_source(part: dict) -> ImageSource:
    """An image part's bytes (data: URL, base64) or its http(s) URL, for our encode."""
    url = _url(part, "image_url")
    if url.startswith("data:"):
        return ImageSource(data=_base64(_data_url(url, "image")[1], "an image"))
    if url.startswith(("http://", "https://")):
        return ImageSource(url=url)
    raise errors.InvalidInput(f"image url must be a data: or http(s) URL, got {url[:40]!r}")


def video_source(part: dict, options: dict, frames_fps: float) -> VideoSource:
    """A video part's container file (data: URL), frames (vLLM's data:video/jpeg sequence, at `frames_fps`)
    or http(s) URL, with the request's `options`, for our encode."""
    url = _url(part, "video_url")
    if url.startswith("data:"):
        media_type, payload = _data_url(url, "video")
        if media_type == "video/jpeg":
            frames = tuple(_base64(f, "a video/jpeg frame of a") for f in payload.split(","))
            return VideoSource(frames=frames, frames_fps=frames_fps, **options)
        return VideoSource(data=_base64(payload, "a video"), **options)
    if url.startswith(("http://", "https://")):
        return VideoSource(url=url, **options)
    raise errors.InvalidInput(f"video url must be a data: or http(s) URL, got {url[:40]!r}")


def video_options(body: dict) -> tuple[dict, float]:
    """(our encode's options for the request's videos, from its mm_processor_kwargs; the frame rate of its
    JPEG sequences, its media_io_kwargs["video"]["fps"] or vLLM's default)."""
    kwargs, video_io = _dict(body, "mm_processor_kwargs"), _dict(body, "media_io_kwargs").get("video")
    frames_fps = video_io.get("fps", JPEG_SEQUENCE_FPS) if isinstance(video_io, dict) else JPEG_SEQUENCE_FPS
    return {ours: kwargs[theirs] for theirs, ours in VIDEO_KWARGS.items() if theirs in kwargs}, frames_fps


def _dict(body: dict, key: str) -> dict:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise errors.InvalidInput(f"{key} must be an object")
    return value


def _npy_base64(value: float) -> str:
    """A float32 scalar as vLLM takes a tensor in an embeds part: base64 of a .npy file (no pickle)."""
    out = io.BytesIO()
    np.save(out, np.asarray(value, dtype=np.float32), allow_pickle=False)
    return base64.b64encode(out.getvalue()).decode()


# What vLLM 0.33 needs beside a video's grid, per family of the encoder (its /v1/metadata "family"), to build
# the video's placeholder and M-RoPE positions as its own processor would from the same frames:
#   qwen2_vl    nothing (its M-RoPE steps time by 1 per frame group)
#   qwen2_5_vl  second_per_grid_ts: M-RoPE's time step. vLLM takes JSON arrays only for the keys its parser
#               declares (the grid), so it goes as a tensor (vLLM's own processor makes it a float32 scalar)
#   qwen3_vl    timestamps: each group's `<t seconds>` text (Qwen3-VL-MoE's family too: the same tower)
VIDEO_METADATA = {
    "qwen2_vl": lambda info: {},
    "qwen2_5_vl": lambda info: {"second_per_grid_ts": _npy_base64(info.second_per_grid_t)},
    "qwen3_vl": lambda info: {"timestamps": list(info.group_timestamps)},
}


def video_family(family: str) -> str:
    """`family` (the encoder's) when vLLM can take its videos as embeddings; InvalidInput else."""
    if family not in VIDEO_METADATA:
        raise errors.InvalidInput(f"vllm-proxy gives vLLM the videos of {', '.join(VIDEO_METADATA)} only; the "
                                  f"encoder serves {family}")
    return family


def video_metadata(info: VideoInfo, family: str) -> dict:
    """A video_embeds part's metadata: its grid and what `family` needs besides (VIDEO_METADATA)."""
    return {"video_grid_thw": list(info.video_grid_thw), **VIDEO_METADATA[video_family(family)](info)}


def embeds_part(info, family: str | None = None) -> dict:
    """The metadata-only part vLLM's EC consumer takes for one encoded image or video (`info`: our ImageInfo
    or VideoInfo; `family`: the encoder's, for a video)."""
    if isinstance(info, VideoInfo):
        return {"type": "video_embeds", "video_embeds": video_metadata(info, family), "uuid": info.id}
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": list(info.grid_thw)}, "uuid": info.id}


def rewrite(body: dict, infos: Sequence, family: str | None = None) -> dict:
    """A copy of `body` with its image and video parts (media_parts order) replaced by `embeds_part(infos[k])`,
    our ids in `ec_transfer_params`, and the video options taken out (video_options)."""
    out = copy.deepcopy(body)
    parts = media_parts(out)
    if len(parts) != len(infos):
        raise ValueError(f"{len(parts)} image and video parts, {len(infos)} encoded")
    for part, info in zip(parts, infos):
        part.clear()
        part.update(embeds_part(info, family))
    if any(isinstance(i, VideoInfo) for i in infos):
        _take(out, "mm_processor_kwargs", VIDEO_KWARGS)
        media_io = _dict(out, "media_io_kwargs")
        if isinstance(media_io.get("video"), dict):
            _take(media_io, "video", ("fps",))
            if not media_io:
                del out["media_io_kwargs"]
    if infos:
        params = dict(out.get("ec_transfer_params") or {})
        params[PARAMS_KEY] = {"ids": [i.id for i in infos]}
        out["ec_transfer_params"] = params
    return out


def _take(body: dict, key: str, names) -> None:
    """Remove `names` from body[key] (a dict), and body[key] once it is empty."""
    rest = {k: v for k, v in _dict(body, key).items() if k not in names}
    if rest:
        body[key] = rest
    else:
        body.pop(key, None)


# ---- the app ----------------------------------------------------------------------------------------------
def _error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _encoder_error(exc: errors.EncoderServiceError):
    """A failed encode as the caller's answer, in OpenAI's error shape: the status the encoder answered
    (over HTTP; else the status of the error's kind), our message, and the kind as the error's type."""
    status = exc.status if isinstance(getattr(exc, "status", None), int) else http_status(exc)
    return _error(status, f"encoder service: {exc.message}", exc.kind)


async def _body(request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (PayloadTooLarge past it: never buffered beyond)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise errors.PayloadTooLarge.declared(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise errors.PayloadTooLarge.received(len(body), limit)
    return bytes(body)


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
    known: dict[str, str] = {}  # what the encoder told us that does not change

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

    async def encode(body: dict, parts: list[dict]) -> tuple[list, str | None]:
        """Our encode of the parts' images, then of their videos (one call each): (infos in `parts`' order, the
        encoder's family when there are videos). A failed video encode releases the images' pins."""
        # wait=True: the answer comes once the ViT has run, so an item that fails to decode or encode fails
        # here, with our reason, and never reaches vLLM (whose front end would answer a failed item with a bare
        # 500: docs/vllm.md). What it costs: vLLM's own request handling no longer overlaps the ViT; the
        # connector's fetch waited for the ViT anyway.
        images = [image_source(p) for p in parts if not is_video(p)]
        videos = [p for p in parts if is_video(p)]
        if videos:
            options, frames_fps = video_options(body)
            videos = [video_source(p, options, frames_fps) for p in videos]
        image_infos = await the_encoder().encode(images, wait=True) if images else []
        video_infos, family = [], None
        try:
            if videos:
                family = video_family(await encoder_family())
                video_infos = await the_encoder().encode_videos(videos, wait=True)
        except Exception:  # noqa: BLE001 - any failure: the images' pins go, then the error is answered
            if image_infos:
                await release(sorted({i.id for i in image_infos}))
            raise
        infos = {False: iter(image_infos), True: iter(video_infos)}
        return [next(infos[is_video(p)]) for p in parts], family

    async def encoder_family() -> str:
        """The encoder's family (its /v1/metadata), asked once."""
        if "family" not in known:
            known["family"] = (await the_encoder().metadata())["family"]
        return known["family"]

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        try:
            body = json.loads(await _body(request, settings.max_body_bytes))
        except errors.PayloadTooLarge as exc:
            return _error(413, str(exc), exc.kind)
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        ids: list[str] = []
        try:
            parts = media_parts(body)
            if parts:
                infos, family = await encode(body, parts)
                ids = sorted({i.id for i in infos})
                body = rewrite(body, infos, family)
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
