"""SGLang's encoder-server endpoints (0.5.23, sglang/srt/disaggregation/encoder/), a thin adapter over the core.

POST /encode                 {"req_id", "mm_items", "num_parts", "part_idx", "modality", "prefill_host",
                              "embedding_port", ...}: encode the part's images (the core: its cache, single
                              flight and batching), then push [header, rows] to the language side (push.py):
                              to prefill_host:embedding_port (zmq_to_tokenizer), else to every rank that
                              registered for the req_id (zmq_to_scheduler). Answers `null` after the push,
                              as SGLang's own encoder does; an error answers {"status": "error", "message",
                              "req_id"} with its HTTP status and pushes an error header to the same places.
POST /scheduler_receive_url  {"req_id", "receive_count", "receive_url": "host:port", "modality"}: one rank's
                              PULL address for a part (before or after its /encode: session.py).
GET  /health                 200 while the core is ready (never waits on the GPU), else 503.

mm_items are strings (or {"url": ..., options} dicts): a data: URI or raw base64 is decoded here; an
http(s) URL goes to the core's URL fetcher (only --allow-url-hosts hosts); a local path is never read
(it names a file on the language server's host, and the request comes from the network). Body size, item
count, bytes and pixels: the same limits as /v1/encode. No auth: SGLang sends none (private network only).
A VIDEO part's items are video files, encoded as /v1/encode's videos (frame group by frame group, cached per
group); an item's `preprocess_kwargs` may set fps, num_frames, min_pixels, max_pixels (transformers'
video processor's options). Its header carries the rows of all its videos and the metadata SGLang's
language side builds the prompt and M-RoPE from (header.py: video_timestamps for Qwen3-VL, second_per_grid_ts
for Qwen2/2.5-VL).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from starlette.requests import ClientDisconnect

from encoder_service.api import bodies
from encoder_service.api import errors as api_errors
from encoder_service.api.requests import REQUEST_ID, served
from encoder_service.api.sglang import header as hdr
from encoder_service.api.sglang.push import Pusher, endpoint
from encoder_service.api.sglang.session import Part, Sessions
from encoder_service.core import EncoderCore, ImageInput
from encoder_service.core.types import VideoInput
from encoder_service.errors import EncoderServiceError, InvalidInput
from encoder_service.protocol.wire import row_bytes

log = logging.getLogger(__name__)

# Keys of an mm_items dict that change nothing here: SGLang's content hash (we hash the bytes ourselves) and
# the OpenAI `detail` (Qwen-VL has no such option). Any other option would change the embedding and is refused.
_IGNORED_ITEM_KEYS = {"content_hash", "detail"}
_REGISTER_MAX_BYTES = 64 << 10  # a registration is a few hundred bytes


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang adds fields we don't need (encoder_idx, time_stats_json)


class EncodeBody(_Body):
    req_id: StrictStr
    mm_items: list[StrictStr | dict]
    num_parts: StrictInt
    part_idx: StrictInt
    modality: StrictStr
    prefill_host: StrictStr | None = None
    embedding_port: StrictInt | None = None


class RegisterBody(_Body):
    req_id: StrictStr
    receive_count: StrictInt
    receive_url: StrictStr
    modality: StrictStr | None = None


def create_app(core: EncoderCore, sessions: Sessions, pusher: Pusher) -> FastAPI:
    max_body, read_timeout_s = core.settings.limits.max_body_bytes, core.settings.server.read_timeout_s
    metrics, access_log = core.metrics, core.settings.server.access_log
    app = FastAPI(title="encoder_service (SGLang protocol)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        ok = core.ready()
        return JSONResponse({"status": "ok" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.post("/encode")
    async def encode(request: Request):
        body = part = None
        with served(metrics, "sglang", "encode", request.headers.get(REQUEST_ID), access_log=access_log) as serving:
            try:
                body = bodies.parse(EncodeBody, await bodies.bounded(request, max_body, read_timeout_s).body())
                validate_encode(body)
                part = sessions.open_encode(body.req_id)
                await _encode(body, part)
                response = JSONResponse(None)
            except ClientDisconnect:  # gone mid-upload, as /v1/encode counts it: no body, so nobody to tell
                serving.observed.cancelled()
                response = Response(status_code=499)
            except Exception as exc:  # noqa: BLE001 -- every failure must reach the language side
                serving.observed.failed(exc)
                response = await _fail(body, part, exc)
            response.headers[REQUEST_ID] = serving.request_id
            return response

    @app.post("/scheduler_receive_url")
    async def scheduler_receive_url(request: Request):
        body = None
        with served(metrics, "sglang", "register", request.headers.get(REQUEST_ID),
                    access_log=access_log) as serving:
            try:
                register = bodies.bounded(request, _REGISTER_MAX_BYTES, read_timeout_s)
                body = bodies.parse(RegisterBody, await register.body())
                if not body.req_id:
                    raise InvalidInput("req_id must be a non-empty string")
                endpoint(body.receive_url)  # a well-formed host:port, or InvalidInput
                part = sessions.register(body.req_id, body.receive_url, body.receive_count)
                if part.error is not None:  # the part failed before this rank registered: tell it now
                    await _push_quietly([body.receive_url], [part.error], persistent=True)
                response = JSONResponse(None)
            except EncoderServiceError as exc:
                serving.observed.failed(exc)
                response = _error_response(exc, body.req_id if body is not None else None)
            response.headers[REQUEST_ID] = serving.request_id
            return response

    async def _encode(body: EncodeBody, part: Part) -> None:
        if body.modality == "VIDEO":
            videos = [video_input(i, item) for i, item in enumerate(body.mm_items)]
            result = await core.encode([], videos=videos, wait=True, return_embeddings=True,
                                       timeout_s=sessions.ttl_s)
            infos, grids, aux = result.videos, [v.video_grid_thw for v in result.videos], video_aux(result.videos)
        else:
            images = [image_input(i, item) for i, item in enumerate(body.mm_items)]
            result = await core.encode(images, wait=True, return_embeddings=True, timeout_s=sessions.ttl_s)
            infos, grids, aux = result.images, [info.grid_thw for info in result.images], None
        # The rows go out in the push below and nothing fetches these ids: their encode pins (leases) end now,
        # instead of holding --max-pinned-bytes for --lease-s (until then further encodes would be 429).
        core.release([info.id for info in infos])
        rows = result.embeddings[0] if len(result.embeddings) == 1 else torch.cat(result.embeddings)
        rows = rows.contiguous()
        frames = [hdr.embedding_header(body.req_id, body.num_parts, body.part_idx, grids, list(rows.shape),
                                       core.dtype, body.modality, aux=aux),
                  row_bytes(rows)]
        if body.embedding_port is not None:  # zmq_to_tokenizer: the tokenizer's own per-request port
            await pusher.send(f"{body.prefill_host}:{body.embedding_port}", frames, persistent=False)
        else:  # zmq_to_scheduler: every rank that registered (they may still be on their way)
            urls = await sessions.wait_registered(part)
            await asyncio.gather(*(pusher.send(url, frames, persistent=True) for url in urls))
        sessions.finish(part)

    async def _fail(body: EncodeBody | None, part: Part | None, exc: Exception) -> JSONResponse:
        """Answer the /encode with the error and push its error header wherever the part's rows would go.
        `part`: the one this /encode opened; None when it failed before that (then the part its ranks
        registered for, if any)."""
        if not isinstance(exc, EncoderServiceError):
            log.exception("SGLang /encode failed")
            exc = EncoderServiceError("internal error")
        if body is None:
            return _error_response(exc, None)
        opened = part
        if part is None:  # failed before this /encode opened its part
            part = sessions.get(body.req_id)
            if part is not None and part.encoding:  # a duplicate: the /encode running must not be disturbed
                return _error_response(exc, body.req_id)
        message = f"encoder_service: {exc.message}"
        code = api_errors.http_status(exc)
        try:
            error = hdr.error_header(body.req_id, body.num_parts, body.part_idx, message, code,
                                     body.modality if body.modality in hdr.MODALITIES else "IMAGE")
        except ValueError:  # no header can carry this part (e.g. a bad part_idx): the HTTP answer alone
            return _error_response(exc, body.req_id)
        if body.embedding_port is not None:
            await _push_quietly([f"{body.prefill_host}:{body.embedding_port}"], [error], persistent=False)
            if opened is not None:  # no rank registers for a tokenizer part: nothing to keep it for
                sessions.finish(opened)
        elif part is not None:
            sessions.fail(part, error)  # ranks registering later get it too
            await _push_quietly(part.receive_urls, [error], persistent=True)
        return _error_response(exc, body.req_id)

    async def _push_quietly(urls, frames, *, persistent: bool) -> None:
        results = await asyncio.gather(*(pusher.send(u, frames, persistent=persistent) for u in urls),
                                       return_exceptions=True)
        for url, r in zip(urls, results):
            if isinstance(r, BaseException):
                log.warning("could not push an error header to %s: %s", url, r)

    return app


def validate_encode(body: EncodeBody) -> None:
    """What SGLang's own encoder checks (runtime.py validate_encode_request), plus the destination."""
    if not body.req_id:
        raise InvalidInput("req_id must be a non-empty string")
    if body.modality not in hdr.MODALITIES:
        raise InvalidInput(f"modality must be one of {', '.join(hdr.MODALITIES)}, got {body.modality!r:.50}")
    if body.modality not in ("IMAGE", "VIDEO"):
        raise InvalidInput(f"this encoder serves images and videos, got modality {body.modality}")
    if not body.mm_items:
        raise InvalidInput("mm_items must not be empty")
    if body.num_parts <= 0:
        raise InvalidInput(f"num_parts must be > 0, got {body.num_parts}")
    if not 0 <= body.part_idx < body.num_parts:
        raise InvalidInput(f"part_idx must be in [0, {body.num_parts}), got {body.part_idx}")
    if body.embedding_port is not None:
        if not body.prefill_host:
            raise InvalidInput("embedding_port is set (zmq_to_tokenizer) but prefill_host is empty")
        endpoint(f"{body.prefill_host}:{body.embedding_port}")


def image_input(index: int, item: str | dict) -> ImageInput:
    """One mm_items entry -> the core's ImageInput (bytes, or an http(s) URL the core fetches)."""
    where = f"mm_items[{index}]"
    if isinstance(item, dict):
        options = sorted(set(item) - {"url"} - _IGNORED_ITEM_KEYS)
        if options:
            raise InvalidInput(f"{where}: per-item options {options} are not supported (this encoder preprocesses "
                               "every image as the checkpoint's processor config says)")
    data, url = _source(where, item, "image")
    return ImageInput(data=data, url=url)


def video_input(index: int, item: str | dict) -> VideoInput:
    """One mm_items entry of a VIDEO part -> the core's VideoInput (a file's bytes, or its URL), with the
    transformers options its `preprocess_kwargs` names (SGLang's VideoData.preprocess_kwargs)."""
    where = f"mm_items[{index}]"
    options = {}
    if isinstance(item, dict):
        unknown = sorted(set(item) - {"url", "preprocess_kwargs"} - _IGNORED_ITEM_KEYS)
        kwargs = item.get("preprocess_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise InvalidInput(f"{where}: preprocess_kwargs must be an object")
        unknown += sorted(f"preprocess_kwargs.{k}" for k in set(kwargs) - set(_VIDEO_OPTIONS))
        if unknown:
            raise InvalidInput(f"{where}: per-item options {unknown} are not supported (a video takes "
                               f"preprocess_kwargs {', '.join(_VIDEO_OPTIONS)})")
        options = dict(kwargs)
    data, url = _source(where, item, "video")
    return VideoInput(data=data, url=url, **options)


_VIDEO_OPTIONS = ("fps", "num_frames", "min_pixels", "max_pixels")  # preprocessing/video.py: VideoOptions


def video_aux(videos) -> dict:
    """A VIDEO part's metadata for SGLang's language side, per video in order (header.py): Qwen3-VL's frame
    group times, or Qwen2/2.5-VL's seconds per frame group (a VideoInfo holds the one its family needs)."""
    if videos[0].group_timestamps is not None:
        return {"video_timestamps": [list(v.group_timestamps) for v in videos]}
    return {"second_per_grid_ts": [float(v.second_per_grid_t) for v in videos]}


def _source(where: str, item: str | dict, kind: str) -> tuple[bytes | None, str | None]:
    """(bytes, None) of a data: URI or raw base64, (None, url) of an http(s) URL."""
    if isinstance(item, dict):
        item = item.get("url")
        if not isinstance(item, str):
            raise InvalidInput(f"{where}: an item object needs a string 'url'")
    if item.startswith(("http://", "https://")):
        return None, item
    if item.startswith("data:"):
        head, sep, payload = item.partition(",")
        if not sep or not head.lower().endswith(";base64"):
            raise InvalidInput(f"{where}: a data: URI must be data:<mime>;base64,<data>")
        return bodies.b64(where, payload), None
    if not item.startswith("file:"):
        try:
            return base64.b64decode(item, validate=True), None
        except (binascii.Error, ValueError):
            pass
    raise InvalidInput(f"{where}: not a data: URI, base64 or an http(s) URL ({item[:60]!r}); local file paths are "
                       f"never read (send the {kind} inline, or by URL from an --allow-url-hosts host)")


def _error_response(exc: EncoderServiceError, req_id: str | None) -> JSONResponse:
    """SGLang's own error shape: the language side reads `message` (receiver.py _extract_encoder_error)."""
    return JSONResponse({"status": "error", "message": f"encoder_service: {exc.message}", "req_id": req_id},
                        status_code=api_errors.http_status(exc), headers=api_errors.answer_headers(exc))
