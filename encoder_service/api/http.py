"""HTTP adapter (FastAPI) over EncoderCore. Thin: parse, call the core, map errors once (api/errors.py).

POST /v1/encode   multipart (field `image`, repeated; options in the query, `id` for one image), a binary
                  body (application/octet-stream or image/*, one image; options in the query), or JSON
                  {"images": [{"data": b64} | {"url": ...}, "id"?], "wait", "return_embeddings", "timeout_s",
                  "ipc"?}. Videos the same ways (api/video_bodies.py): multipart `video` / `frame` fields, a
                  video/* body, JSON {"videos": [...]}; answered as {"videos": [VideoInfo], "timings"}.
                  Images with "ipc": {"host", "hold", "ack"} (JSON; the query's `ipc_host` and `ipc_ack`,
                  comma-separated tokens, for a binary or multipart body of images: a video body refuses them,
                  400, and so does `ipc_ack` without `ipc_host`; implies wait): each image's answer carries
                  "ipc": where its rows sit in the device row arena (a hold) or why not, as a fetch's.
POST /v1/fetch    JSON {"items": [{"id", "offset"}], "start", "end", "timeout_s"} -> protocol/wire.py payload
                  (application/octet-stream; application/safetensors when Accept asks for it).
                  With "shm": {"name", "offset", "by_position"} the rows go into that client file
                  (protocol/shm.py) and the answer is JSON: the wire header's fields + "shm_bytes".
                  With "ipc": {"host", "hold", "ack"} (protocol/ipc.py) the answer is JSON: the wire header's
                  fields + "ipc": where each segment's rows sit in the device row arena, or why not.
POST /v1/fetch/ack  JSON {"tokens": [...]} -> {"released": n}: ends the holds of fetches by IPC.
POST /v1/fetch/pickup  JSON {"token"} -> the payload of the gRPC Fetch that left that ticket (api/pickup.py).
POST /v1/release  JSON {"ids": [...]} -> {"released": n, "invalid": [{"id", "reason"}]}: ends those ids' encode
                  pins early; malformed ids are listed in "invalid" (not released), the others released.
GET  /health/live, /health/ready (with detail: {"ready", "redis": "up" | "down" | "off"}), /v1/metadata,
     /metrics.
The body limit is enforced while reading: Content-Length first, then by counting received bytes.
JSON bodies are strict: unknown fields, and values of another JSON type ("5" or true for a number), are 400;
so is a multipart body the parser refuses (no boundary, no parts, too many files or fields), naming why, and a
query option the body does not take or one given twice (api/query_options.py). A body that stops arriving
for --read-timeout-s, or has not arrived whole by then plus its length at api/bodies.py's MIN_BODY_RATE, is 408
(the outcome `request_timeout`) and its connection closed (api/read_timeouts.py).
Starlette's own answers (404 unknown path, 405 wrong method) come in the same error shape. Every answer of
the three POSTs carries its request id (x-request-id: api/requests.py).
A client that goes away mid-upload, or while the core works for it (watched: ASGI's http.disconnect), or
before a fetch's rows are all sent (a request is observed until its answer is sent: `_Served`), is counted
as the outcome `cancelled` and logged at debug; in the second case the core's call is cancelled, so the
images and rows it waited for lose a waiter at once (core/flight.py: nobody left, the work is dropped).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable
from typing import Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from encoder_service.api import bodies, query_options, video_bodies
from encoder_service.api import errors as api_errors
from encoder_service.api.auth import BearerAuth
from encoder_service.api.pickup import Pickups
from encoder_service.api.requests import REQUEST_ID, served
from encoder_service.api.rows_response import RowsResponse
from encoder_service.api.socket_send import EXTENSION
from encoder_service.core import EncoderCore, FetchItem, ImageInput
from encoder_service.core.types import VideoInput
from encoder_service.errors import (EncoderServiceError, InvalidInput, LimitExceeded, NotFound, Unauthenticated,
                                   UnsupportedMediaType)
from encoder_service.protocol import peer_auth, wire
from encoder_service.protocol.dtypes import dtype_name
from encoder_service.protocol.errors import kind_from_status
from encoder_service.protocol.ipc import IpcError, IpcRequest
from encoder_service.protocol.shm import ShmTarget
from encoder_service.protocol.timing import timing_headers

log = logging.getLogger(__name__)

T = TypeVar("T")
SAFETENSORS = "application/safetensors"
OCTET = "application/octet-stream"


class _Strict(BaseModel):
    # strict: no coercion ("5" or true is not a number, 1 is not a bool); a JSON int still passes as a float.
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageJson(_Strict):
    data: str | None = None  # base64 of the encoded image
    url: str | None = None
    id: str | None = None  # optional caller-supplied id


class VideoJson(_Strict):
    data: str | None = None  # base64 of the container file
    frames: list[str] | None = None  # base64 of each frame's image file, in order
    url: str | None = None
    id: str | None = None
    fps: float | None = None
    num_frames: int | None = None
    sample_frames: bool | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    frames_fps: float | None = None


class IpcJson(_Strict):
    host: str  # the consumer's boot id
    hold: bool = True
    ack: list[str] = []  # tokens of earlier fetches by IPC whose copies are done


class EncodeJson(_Strict):
    images: list[ImageJson] = []
    videos: list[VideoJson] = []
    wait: bool = False
    return_embeddings: bool = False
    timeout_s: float | None = None
    ipc: IpcJson | None = None  # the rows by IPC as soon as they land (protocol/ipc.py), per image


class FetchItemJson(_Strict):
    id: str
    offset: int


class ShmJson(_Strict):
    name: str
    offset: int
    by_position: bool = False


class FetchJson(_Strict):
    items: list[FetchItemJson]
    start: int
    end: int
    timeout_s: float | None = None
    shm: ShmJson | None = None
    peer: Literal["fetch", "copy"] | None = None  # another replica fetching (replicas/peers.py): only what is here
    ipc: IpcJson | None = None


class AckJson(_Strict):
    tokens: list[str]


class ReleaseJson(_Strict):
    ids: list[str]


class PickupJson(_Strict):
    token: str


def create_app(core: EncoderCore, pickups: Pickups | None = None) -> ASGIApp:
    """The FastAPI app over `core`; the core's lifecycle belongs to the caller (api/service.py). `pickups`:
    rows gRPC fetches left for their clients (shared with the gRPC server)."""
    settings = core.settings
    auth = BearerAuth(settings.server.auth_token)
    owner = core.replicas.owner  # what peers' signatures address (None: no peers)
    max_body, read_timeout_s = settings.limits.max_body_bytes, settings.server.read_timeout_s
    metrics, access_log = core.metrics, settings.server.access_log
    app = FastAPI(title="encoder_service", version="1", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(EncoderServiceError)
    async def _service_error(request: Request, exc: EncoderServiceError):
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def _framework_error(request: Request, exc: HTTPException):
        """Starlette's own answers (an unknown path, a method a path does not take) in our error shape."""
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = {"error": {"kind": kind_from_status(exc.status_code) or "invalid_input", "message": message}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.get("/health/live")
    async def live():
        ok = core.live()
        return JSONResponse({"live": ok}, status_code=200 if ok else 503)

    @app.get("/health/ready")
    async def ready():
        body = core.readiness()
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/metadata")
    async def metadata(request: Request):
        auth.check(request.headers.get("authorization"))
        return core.metadata()

    async def _encode(request: Request) -> Response:
        auth.check(request.headers.get("authorization"))
        ctype = _content_type(request)
        bounded = bodies.bounded(request, max_body, read_timeout_s)
        q = request.query_params
        query_options.bounded(q, "POST /v1/encode")
        octet = query_options.OCTET if ctype == OCTET else ()
        if ctype != "application/json":  # which of them the body takes: checked below
            wait, embeds, timeout_s = _qbool(q, "wait"), _qbool(q, "return_embeddings"), _qfloat(q, "timeout_s")
        videos = []
        if ctype == "application/json":
            query_options.check(q, (), "POST /v1/encode with a JSON body (its options go in the body)")
            body = bodies.parse(EncodeJson, await bounded.body())
            images = [_json_image(i, img) for i, img in enumerate(body.images)]
            videos = [video_bodies.json_video(i, v) for i, v in enumerate(body.videos)]
            wait, embeds, timeout_s = body.wait, body.return_embeddings, body.timeout_s
            ipc = _ipc_request(body.ipc.host, body.ipc.hold, body.ipc.ack) if body.ipc is not None else None
        elif ctype == "multipart/form-data":
            images, videos = await _multipart_media(bounded, settings, q)
        elif ctype.startswith("video/") or (ctype == OCTET and _qbool(q, "video")):
            query_options.check(q, query_options.VIDEO + octet, "POST /v1/encode with a video body")
            images, videos = [], [VideoInput(data=await bounded.body(), caller_id=q.get("id"),
                                             **video_bodies.query_options(q))]
        elif ctype == OCTET or ctype.startswith("image/"):
            query_options.check(q, query_options.IMAGE + octet, "POST /v1/encode with an image body")
            images = [ImageInput(data=await bounded.body(), caller_id=q.get("id"))]
        else:
            raise _unsupported(ctype, "application/json, multipart/form-data, application/octet-stream, image/* "
                                      "or video/*")
        if ctype != "application/json":  # the query's options checked above (a video body takes no ipc_*)
            ipc = _query_ipc(q)
        result = await _unless_disconnected(request, core.encode(images, wait=wait, return_embeddings=embeds,
                                                                 timeout_s=timeout_s, videos=videos, ipc=ipc))
        kind, infos = ("videos", result.videos) if videos else ("images", result.images)
        out = []
        for i, info in enumerate(infos):
            d = info.to_json()
            if result.embeddings is not None:
                rows = result.embeddings[i]
                d["embedding"] = {"data": base64.b64encode(wire.row_bytes(rows)).decode("ascii"),
                                  "dtype": dtype_name(rows.dtype), "shape": list(rows.shape)}
            if result.ipc is not None:
                d["ipc"] = result.ipc[i].to_dict()
            out.append(d)
        return JSONResponse({kind: out, "timings": result.timings}, headers=dict(timing_headers(result.timings)))

    async def _fetch(request: Request) -> Response:
        body = await _json_body(request, FetchJson, peer_path="/v1/fetch")
        shm = ShmTarget(body.shm.name, body.shm.offset, body.shm.by_position) if body.shm is not None else None
        ipc = _ipc_request(body.ipc.host, body.ipc.hold, body.ipc.ack) if body.ipc is not None else None
        result = await _unless_disconnected(request, core.fetch(
            [FetchItem(it.id, it.offset) for it in body.items], body.start, body.end, timeout_s=body.timeout_s,
            shm=shm, ipc=ipc, peer=body.peer))
        header = wire.WireHeader.of_fetch(result)
        if result.ipc is not None:  # where the rows sit on the GPU (or why not): the header and that answer
            return JSONResponse(header.to_dict() | {"ipc": result.ipc.to_dict()},
                                headers=dict(timing_headers(result.timings)))
        if shm is not None:  # the rows are in the client's file: the header alone answers
            return JSONResponse(header.to_dict() | {"shm_bytes": result.shm_bytes},
                                headers=dict(timing_headers(result.timings)))
        if SAFETENSORS in request.headers.get("accept", ""):
            (prefix, rows), media = wire.safetensors_parts(header, result.rows), SAFETENSORS
        else:
            (prefix, rows), media = wire.http_parts(header, result.rows), OCTET
        return RowsResponse(prefix, rows, media, dict(timing_headers(result.timings)))

    async def _pickup(request: Request) -> Response:
        body = await _json_body(request, PickupJson)
        taken = pickups.take(body.token) if pickups is not None else None
        if taken is None:
            raise NotFound("pickup token unknown, used or expired: a token works once, for a few seconds after "
                           "the gRPC Fetch that answered it")
        prefix, rows = wire.http_parts(*taken)
        return RowsResponse(prefix, rows, OCTET, {})

    async def _json_body(request: Request, model: type[_Strict], peer_path: str | None = None):
        """Auth, then a JSON body of at most max_body bytes parsed into `model` (fetch, pickup and release).
        `peer_path`: the row path, where another replica's signature of the request stands for the token, for
        a fetch marked `peer` only: its form, replica and time checked before the body is read, which is then
        read up to peer_auth.MAX_BODY_BYTES only (a peer's fetch is one item) and checked against the
        signature."""
        authorization = request.headers.get("authorization")
        signed = peer_path is not None and auth.signed_by_peer(authorization)
        signature = auth.addressed_to(authorization, owner) if signed else None
        if not signed:
            auth.check(authorization)
        ctype = _content_type(request)
        if ctype != "application/json":
            raise _unsupported(ctype, "application/json")
        query_options.check(request.query_params, (), f"POST {request.url.path} (its options go in the JSON body)")
        limit = min(max_body, peer_auth.MAX_BODY_BYTES) if signed else max_body
        raw = await bodies.bounded(request, limit, read_timeout_s).body()
        if signed:
            auth.check_peer(signature, "POST", peer_path, raw)
        body = bodies.parse(model, raw)
        if signed and getattr(body, "peer", None) is None:
            raise Unauthenticated("a replica's signature authorizes its own fetches only (marked \"peer\")")
        return body

    async def _ack(request: Request) -> Response:
        body = await _json_body(request, AckJson)
        return JSONResponse({"released": core.ipc.ack(_ipc_request("", True, body.tokens).ack)})

    async def _release(request: Request) -> Response:
        body = await _json_body(request, ReleaseJson)
        return JSONResponse(core.release(body.ids).to_json())

    posts = {path: _Served(method, handler, metrics, access_log) for path, method, handler in (
        ("/v1/encode", "encode", _encode), ("/v1/fetch", "fetch", _fetch), ("/v1/fetch/ack", "ack", _ack),
        ("/v1/fetch/pickup", "pickup", _pickup), ("/v1/release", "release", _release))}
    for path, endpoint in posts.items():
        app.router.add_route(path, endpoint, methods=["POST"])
    return _Posts(app, posts)


class _Posts:
    """The HTTP app: a POST to one of our endpoints goes straight to its `_Served` (which answers every error
    itself), everything else through FastAPI (health, metrics, metadata, unknown paths and methods): Starlette's
    middleware and routing are a visible share of a small fetch's server time (an IPC fetch's answer is a few
    hundred bytes). The same routes are in FastAPI's router too, so the app behaves the same either way."""

    def __init__(self, app: FastAPI, posts: dict[str, _Served]):
        self.app, self._posts = app, posts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._posts.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self.app  # as Starlette sets it (its form parser's errors depend on it)
                return await endpoint(scope, receive, send)
        await self.app(scope, receive, send)


class _Served:
    """One POST endpoint as an ASGI app (starlette routes to an object that is not a function as it is), so
    that its request (api/requests.py: its id, metrics, access line) is observed until its answer is sent:
    rows a client left before taking count `cancelled`, not `ok` (api/rows_response.py: `delivered`). Errors
    are answered here so they are counted too; every answer carries the request id."""

    def __init__(self, method: str, handler, metrics, access_log: bool):
        self._method, self._handler, self._metrics, self._access_log = method, handler, metrics, access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request, method = Request(scope, receive, send), self._method
        with served(self._metrics, "http", method, request.headers.get(REQUEST_ID),
                    access_log=self._access_log) as serving:
            response = await self._answer(request, serving)
            response.headers[REQUEST_ID] = serving.request_id
            writer = scope.get("extensions", {}).get(EXTENSION)
            whole = writer is not None and not isinstance(response, RowsResponse)
            try:
                with writer.whole_answer() if whole else contextlib.nullcontext():
                    await response(scope, receive, send)
            except Exception as exc:  # the answer could not be sent (a bug: the server logs it)
                serving.observed.failed(exc)
                raise
            if isinstance(response, RowsResponse) and not response.delivered:
                serving.observed.cancelled()
                log.debug("HTTP %s: the client left before its rows were sent", method)

    async def _answer(self, request: Request, serving) -> Response:
        try:
            return await self._handler(request)
        except EncoderServiceError as exc:
            serving.observed.failed(exc)
            return _error_response(exc)
        except ClientDisconnect:  # gone mid-upload or mid-call: nobody reads an answer, not our failure
            serving.observed.cancelled()
            log.debug("HTTP %s: the client disconnected before its answer", self._method)
            return Response(status_code=499)  # "client closed request" (nginx's code), for access logs
        except Exception as exc:  # a bug, not a request problem: the traceback in the log, not in the answer
            serving.observed.failed(exc)
            log.exception("HTTP %s failed", self._method)
            return _error_response(exc)


# ---- helpers ---------------------------------------------------------------------------------------------
async def _unless_disconnected(request: Request, call: Awaitable[T]) -> T:
    """`await call` (the core's, once the body is read) in this task, cancelled when the client disconnects
    meanwhile: then ClientDisconnect. With the body read, the server's ASGI receive() only answers
    http.disconnect; a watcher task waits for it (the call runs here, not in a task of its own: a ready
    answer then costs the event loop no task switch)."""
    task, awaiting = asyncio.current_task(), [True]

    def left(g: asyncio.Future) -> None:
        if awaiting[0] and not g.cancelled() and g.exception() is None:  # still in `await call` (or about to
            task.cancel()  # resume from it): cancelled there, never in what the task does after

    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(left)
    try:
        return await call
    except asyncio.CancelledError:
        if gone.done() and not gone.cancelled() and gone.exception() is None:
            task.uncancel()  # our own cancel: the client left (unwound: its flights left, its waits ended)
            raise ClientDisconnect() from None
        raise
    finally:
        awaiting[0] = False
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _query_ipc(q) -> IpcRequest | None:
    """The IPC request of a binary or multipart body of images: `ipc_host` and `ipc_ack` in the query."""
    if "ipc_host" in q:
        return _ipc_request(q["ipc_host"], True, [t for t in q.get("ipc_ack", "").split(",") if t])
    if "ipc_ack" in q:  # its tokens would go unacknowledged, silently
        raise InvalidInput("query option 'ipc_ack' without ipc_host: the tokens are acknowledged with a request "
                           "by IPC (give ipc_host, the consumer's boot id), or by POST /v1/fetch/ack")
    return None


def _ipc_request(host: str, hold: bool, ack: list[str]) -> IpcRequest:
    try:
        return IpcRequest(host, hold, tuple(ack))
    except IpcError as exc:
        raise InvalidInput(str(exc)) from None


def _error_response(exc: Exception) -> JSONResponse:
    return JSONResponse(api_errors.error_body(exc), status_code=api_errors.http_status(exc),
                        headers=api_errors.answer_headers(exc))


def _unsupported(ctype: str, expected: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(f"content type {ctype or '(none)'!r} is not accepted here; send {expected}")


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _json_image(index: int, img: ImageJson) -> ImageInput:
    """The core checks that exactly one of data / url is given (core/images.py: read)."""
    data = None if img.data is None else bodies.b64(f"image {index}: data", img.data)
    return ImageInput(data=data, url=img.url, caller_id=img.id)


async def _multipart_media(request: Request, settings, q) -> tuple[list[ImageInput], list[VideoInput]]:
    """`image` fields (one image each), `video` fields (one video file each) and `frame` fields (together, in
    order, one video given as its frames, at most --max-images of them here: JSON takes more). Each may be a
    file part or a plain field. The query options (api/query_options.py) are those of the fields sent: the
    video options with videos; `id` names the body's one image or video."""
    max_images, bounds = settings.limits.max_images, _part_bounds(settings)
    try:
        form = await request.form(max_files=bounds["files"], max_fields=bounds["fields"])
    except HTTPException as exc:  # the parser's own 400: no boundary, no boundary lines, too many parts
        raise _multipart_error(exc.detail, settings) from None
    try:
        async def read(field: str) -> list[bytes]:
            return [await part.read() if hasattr(part, "read") else str(part).encode() for part in form.getlist(field)]

        with_videos = "video" in form or "frame" in form
        query_options.check(q, query_options.VIDEO if with_videos else query_options.IMAGE,
                            f"POST /v1/encode with a multipart body of {'videos' if with_videos else 'images'}")
        images = [ImageInput(data=data) for data in await read("image")]
        options = video_bodies.query_options(q) if with_videos else {}
        videos = [VideoInput(data=data, **options) for data in await read("video")]
        frames = await read("frame")
        if len(frames) > max_images:
            raise LimitExceeded("number of frame fields in the multipart body", len(frames),
                                f"{max_images} (--max-images; JSON takes a video's frames up to --max-video-frames)")
        if frames:
            videos.append(VideoInput(frames=tuple(frames), **options))
        if not images and not videos and len(form) > 0:
            raise InvalidInput(f"multipart body has no 'image', 'video' or 'frame' field (got fields "
                               f"{sorted(set(form.keys()))})")
        caller_id = q.get("id")
        if caller_id is not None:
            items = images + videos
            if len(items) != 1:
                raise InvalidInput(f"query option 'id' names one image or video, and this multipart body holds "
                                   f"{len(items)}: give each its id in a JSON body")
            items[0] = dataclasses.replace(items[0], caller_id=caller_id)
            images, videos = (items, []) if images else ([], items)
        return images, videos
    finally:
        await form.close()  # its spooled files


def _part_bounds(settings) -> dict[str, int]:
    """The most file parts and plain fields the multipart parser reads (it keeps every part, files spooled):
    above what any request takes (max_videos - 1 video files and max_images frames, or max_images images; as
    plain fields too, with 16 of the client's own), so that the counts checked after it (_multipart_media's,
    the core's) name the limit a request went over and what it sent."""
    files = settings.limits.max_images + settings.video.max_videos
    return {"files": files, "fields": files + 16}


def _multipart_error(detail: str, settings) -> InvalidInput:
    """The parser's refusal as our error: too many parts names the bound it stopped at (having read one more
    part) and the limits the bound stands for; anything else (no boundary, a part without a name) as it said."""
    kind = next((k for k in ("files", "fields") if detail.startswith(f"Too many {k}.")), None)
    if kind is None:
        return InvalidInput(f"multipart body: {detail}")
    limit, max_images = _part_bounds(settings)[kind], settings.limits.max_images
    return LimitExceeded(f"multipart body: number of {'file parts' if kind == 'files' else 'plain fields'}",
                         f"at least {limit + 1}", f"{limit} (no request takes more: at most {max_images} images, "
                         f"--max-images, or {settings.video.max_videos} videos, --max-videos, one of them as up "
                         f"to {max_images} frame fields)")


def _qbool(q, name: str) -> bool:
    value = q.get(name)
    if value is None:
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no", ""):
        return False
    raise InvalidInput(f"query parameter {name} must be true or false, got {value!r}")


def _qfloat(q, name: str) -> float | None:
    value = q.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidInput(f"query parameter {name} must be a number, got {value!r}") from None
