"""HTTP transports (blocking and async) for EncoderClient / AsyncEncoderClient.

Encode sends multipart (raw bytes, field `image`; `video` for videos) unless an image is a URL or carries a
caller id (a video: is not a file, carries a caller id or options of its own), which only the JSON form
(base64) can say. Fetch asks for the octet-stream payload (protocol/wire.py) and reads it
on a plain socket straight into its destination (rowpath/raw_http.py; the async transport runs that blocking
read on its own threads, which receive in parallel with the GIL released); https, a proxy, or an answer the
raw reader does not handle go through httpx, as everything else does. An shm fetch gets a JSON header
(the rows are in the client's file), read on the same plain sockets: through httpx the request's own cost
was that of the write it asks for. So does a fetch by IPC (the header and where the rows sit on the server's
GPU: client/ipc.py), over the server's same-host channel when it has one (client/ipc_channel.py: a Unix socket
kept open; HTTP whenever it can't); its acknowledgements go back to the server that held the rows: `ipc_acks`
(client/ipc.py: Acks, one per transport), taken by this transport's next fetch by IPC or sent by `ack_ipc`
(blocking) on the acks' thread.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx

from encoder_service.client.destination import Destination
from encoder_service.client.ipc import ACK_TIMEOUT_S, Acks
from encoder_service.client.ipc_channel import AsyncChannelLink, ChannelLink
from encoder_service.client.types import ImageInfo, ImageSource, VideoInfo, VideoSource
from encoder_service.errors import DeadlineExceeded, Unavailable, Unreachable
from encoder_service.protocol import wire
from encoder_service.protocol.ipc import IpcError, IpcPlacement, IpcUnavailable, answer_from_dict
from encoder_service.protocol.release import Released
from encoder_service.rowpath.raw_http import (CONNECT_TIMEOUT_S, JSON, OCTET, READ_THREADS, Cancel, NotRaw, RawHttp,
                                              http_error, in_thread, read_fetch, read_json)

log = logging.getLogger(__name__)
# httpx options that route requests somewhere the raw reader would not go.
_ROUTING_OPTIONS = ("transport", "mounts", "proxy", "app")


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _encode_args(images: list[ImageSource], wait: bool, return_embeddings: bool, timeout,
                 ipc: dict | None = None) -> dict:
    """httpx.request keyword arguments for POST /v1/encode (`ipc`: the rows by IPC, protocol/ipc.py)."""
    if all(i.data is not None and i.caller_id is None for i in images):
        params = {"wait": str(wait).lower(), "return_embeddings": str(return_embeddings).lower()}
        if timeout is not None:
            params["timeout_s"] = str(timeout)
        if ipc is not None:
            params |= {"ipc_host": ipc["host"]} | ({"ipc_ack": ",".join(ipc["ack"])} if ipc.get("ack") else {})
        return {"files": [("image", (f"image{k}", i.data, "application/octet-stream")) for k, i in enumerate(images)],
                "params": params}
    body = {"images": [({"data": base64.b64encode(i.data).decode("ascii")} if i.data is not None else {"url": i.url})
                       | ({"id": i.caller_id} if i.caller_id else {}) for i in images],
            "wait": wait, "return_embeddings": return_embeddings, "timeout_s": timeout}
    return {"json": body | ({"ipc": ipc} if ipc is not None else {})}


def _encode_videos_args(videos: list[VideoSource], wait: bool, return_embeddings: bool, timeout) -> dict:
    """httpx.request keyword arguments for POST /v1/encode of videos: multipart (raw bytes, field `video`,
    the options in the query) when every video is a file with the same options and no caller id, else JSON."""
    params = {"wait": str(wait).lower(), "return_embeddings": str(return_embeddings).lower()}
    if timeout is not None:
        params["timeout_s"] = str(timeout)
    same = all(v.data is not None and v.caller_id is None and v.options() == videos[0].options() for v in videos)
    if same:
        options = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in videos[0].options().items()}
        return {"files": [("video", (f"video{k}", v.data, "application/octet-stream")) for k, v in enumerate(videos)],
                "params": params | options}
    body = [_video_json(v) for v in videos]
    return {"json": {"videos": body, "wait": wait, "return_embeddings": return_embeddings, "timeout_s": timeout}}


def _video_json(video: VideoSource) -> dict:
    if video.data is not None:
        source = {"data": _b64(video.data)}
    elif video.frames is not None:
        source = {"frames": [_b64(frame) for frame in video.frames]}
    else:
        source = {"url": video.url}
    return source | ({"id": video.caller_id} if video.caller_id else {}) | video.options()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _infos(response: httpx.Response) -> list[ImageInfo]:
    return [ImageInfo.from_json(d, embedding=_embedding(d) if "embedding" in d else None,
                                ipc=_encode_ipc(d["ipc"]) if "ipc" in d else None)
            for d in response.json()["images"]]


def _encode_ipc(d) -> IpcPlacement | IpcUnavailable:
    """An encode answer's per-image "ipc" (one segment: all the image's rows)."""
    try:
        return answer_from_dict(d, 1)
    except IpcError as exc:
        raise wire.WireError(f"not an encode's ipc answer: {exc}") from None


def _video_infos(response: httpx.Response) -> list[VideoInfo]:
    return [VideoInfo.from_json(d, embedding=_embedding(d) if "embedding" in d else None)
            for d in response.json()["videos"]]


def _embedding(d: dict):
    e = d["embedding"]
    return wire.rows_from_bytes(base64.b64decode(e["data"]), e["dtype"], int(e["shape"][1]), int(e["shape"][0]))


def _fetch_json(items, start: int, end: int, timeout, shm: dict | None = None, ipc: dict | None = None) -> dict:
    body = {"items": [{"id": i, "offset": o} for i, o in items], "start": start, "end": end, "timeout_s": timeout}
    return body | ({"shm": shm} if shm is not None else {}) | ({"ipc": ipc} if ipc is not None else {})


def _shm_reply(answer: dict | httpx.Response) -> tuple[wire.WireHeader, int]:
    """(header, shm_bytes) of an shm fetch's JSON answer (parsed by the raw reader, or httpx's response)."""
    try:
        d = answer.json() if isinstance(answer, httpx.Response) else answer
        return wire.WireHeader.from_dict(d), int(d["shm_bytes"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise wire.WireError(f"not an shm fetch answer: {exc!r}") from None


def _ipc_reply(answer: dict | httpx.Response) -> tuple[wire.WireHeader, IpcPlacement | IpcUnavailable]:
    """(header, where the rows sit or why not) of a fetch by IPC's JSON answer."""
    d = answer.json() if isinstance(answer, httpx.Response) else answer
    header = wire.WireHeader.from_dict(d)
    try:
        return header, answer_from_dict(d["ipc"], len(header.segments))
    except (KeyError, TypeError, IpcError) as exc:
        raise wire.WireError(f"not a fetch by IPC's answer: {exc!r:.200}") from None


def _raw_ack(raw: RawHttp, tokens: list[str], timeout) -> int:
    body = json.dumps({"tokens": tokens}, separators=(",", ":")).encode()
    return int(raw.post("/v1/fetch/ack", body, _time_left(timeout), read_json, accept=JSON)["released"])


def _check(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    raise http_error(response.status_code, response.headers, response.content)


def _raw(base_url: str, token: str | None, connect_timeout_s: float, httpx_kw: dict) -> RawHttp | None:
    """The raw fetch path to `base_url`, unless httpx would route it elsewhere (https, proxies, a custom
    transport)."""
    if any(k in httpx_kw for k in _ROUTING_OPTIONS):
        return None
    return RawHttp.for_url(base_url, _headers(token), trust_env=httpx_kw.get("trust_env", True),
                           connect_timeout_s=connect_timeout_s)


def _time_left(timeout: float | None) -> float | None:
    """`timeout` as a socket or httpx takes it; DeadlineExceeded when none is left (both read 0 as "do not
    block": an error that says nothing of the deadline)."""
    if timeout is not None and timeout <= 0:
        raise DeadlineExceeded(f"the call's timeout is used up ({timeout:g} s left)")
    return timeout


def _timeout(timeout: float | None, connect_timeout_s: float) -> httpx.Timeout:
    """The call's timeout for httpx, its connect bounded by `connect_timeout_s` too."""
    timeout = _time_left(timeout)
    return httpx.Timeout(timeout, connect=connect_timeout_s if timeout is None else min(timeout, connect_timeout_s))


def _fetch_body(items, start: int, end: int, timeout, shm: dict | None = None, ipc: dict | None = None) -> bytes:
    return json.dumps(_fetch_json(items, start, end, timeout, shm, ipc), separators=(",", ":")).encode()


def _release_body(ids) -> bytes:
    return json.dumps({"ids": ids}, separators=(",", ":")).encode()


def _decoded(response: httpx.Response, dest: Destination):
    """(header, rows) of a whole octet-stream body httpx read (the fallback path)."""
    header, data = wire.split_http(response.content)
    dest.writer(header).write(data)
    return header, dest.finish()


class _RawFetch:
    """The raw path of one transport, given up (for httpx) the first time the server answers what it does
    not handle."""

    def __init__(self, raw: RawHttp | None):
        self.raw = raw

    def fetch(self, body: bytes, dest: Destination, timeout, cancel: Cancel | None = None):
        """(header, rows), or None when the raw path is off (or just turned off: ask httpx)."""
        got = self._post(body, timeout, read_fetch(dest.writer), OCTET, cancel)
        return None if got is None else (got[0], dest.finish())

    def fetch_shm(self, body: bytes, timeout, cancel: Cancel | None = None) -> dict | None:
        """An shm fetch's (or a fetch by IPC's) JSON answer, or None as above. httpx's request handling costs as
        much as the fetch itself when the rows are a small shm write (~0.5 ms on the CPU box)."""
        return self._post(body, timeout, read_json, JSON, cancel)

    def release(self, body: bytes, timeout, cancel: Cancel | None = None) -> dict | None:
        """A release's JSON answer, or None as above (httpx's async connection pool costs the client more CPU
        than the request itself: benchmarks/client_cpu.py's profile)."""
        return self._post(body, timeout, read_json, JSON, cancel, "/v1/release")

    def _post(self, body: bytes, timeout, read, accept: str, cancel: Cancel | None, path: str = "/v1/fetch"):
        raw = self.raw
        if raw is None:
            return None
        try:
            return raw.post(path, body, _time_left(timeout), read, accept=accept, cancel=cancel)
        except NotRaw as exc:
            log.warning("fetch over a plain socket got an answer it does not handle (%s); using httpx", exc)
            self.raw = None
            raw.close()
            return None

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()


_FETCH_HEADERS = {"content-type": JSON, "accept": OCTET}
_SHM_HEADERS = {"content-type": JSON, "accept": JSON}


def _transport_error(exc: httpx.TransportError, base_url: str):
    """Network trouble in the service's own terms: a server that cannot be reached (the request never went),
    a timeout, or a connection that failed mid-request."""
    if isinstance(exc, httpx.ConnectTimeout):
        return Unreachable(f"cannot reach {base_url}: the connect timed out ({exc!r})")
    if isinstance(exc, httpx.ConnectError):
        return Unreachable(f"cannot reach {base_url}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return DeadlineExceeded(f"HTTP request timed out: {exc!r}")
    return Unavailable(f"HTTP request failed: {exc!r}")


class HttpTransport:
    """`ipc_channel`: fetches by IPC over the server's same-host channel when it has one (False: HTTP);
    `connect_timeout_s`: each connect's own deadline, within the call's timeout (CONNECT_TIMEOUT_S)."""

    def __init__(self, base_url: str, *, token: str | None = None, ipc_channel: bool = True,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, **httpx_kw):
        self._http = httpx.Client(base_url=base_url, headers=_headers(token), **httpx_kw)
        self._raw = _RawFetch(_raw(base_url, token, connect_timeout_s, httpx_kw))
        self.base_url, self._connect_timeout_s = base_url.rstrip("/"), connect_timeout_s
        self.ipc_acks = Acks(lambda tokens: self.ack_ipc(tokens, ACK_TIMEOUT_S))  # this server's holds, done
        self._channel = ChannelLink(token, self.metadata)
        if not ipc_channel:
            self._channel.close()

    def _post(self, path: str, timeout, **kw) -> httpx.Response:
        try:
            return _check(self._http.post(path, timeout=_timeout(timeout, self._connect_timeout_s), **kw))
        except httpx.TransportError as exc:
            raise _transport_error(exc, self.base_url) from exc

    def encode(self, images, wait, return_embeddings, timeout, ipc: dict | None = None):
        return _infos(self._post("/v1/encode", timeout,
                                 **_encode_args(images, wait, return_embeddings, timeout, ipc)))

    def encode_videos(self, videos, wait, return_embeddings, timeout):
        return _video_infos(self._post("/v1/encode", timeout,
                                       **_encode_videos_args(videos, wait, return_embeddings, timeout)))

    def fetch(self, items, start, end, dest: Destination, timeout):
        body = _fetch_body(items, start, end, timeout)
        got = self._raw.fetch(body, dest, timeout)
        if got is not None:
            return got
        return _decoded(self._post("/v1/fetch", timeout, content=body, headers=_FETCH_HEADERS), dest)

    def fetch_shm(self, items, start, end, target, timeout):
        body = _fetch_body(items, start, end, timeout, target)
        got = self._raw.fetch_shm(body, timeout)
        if got is not None:
            return _shm_reply(got)
        return _shm_reply(self._post("/v1/fetch", timeout, content=body, headers=_SHM_HEADERS))

    def fetch_ipc(self, items, start, end, ipc: dict, timeout):
        got = self._channel.fetch(items, start, end, ipc, _time_left(timeout))
        if got is not None:
            return got
        body = _fetch_body(items, start, end, timeout, ipc=ipc)
        got = self._raw.fetch_shm(body, timeout)
        if got is not None:
            return _ipc_reply(got)
        return _ipc_reply(self._post("/v1/fetch", timeout, content=body, headers=_SHM_HEADERS))

    def ack_ipc(self, tokens: list[str], timeout) -> int:
        """Over the channel when it is up (no answer: how many were live is not known, counted all), else on a
        plain socket when there is one (the client's acks thread calls it beside fetches: httpx's request
        handling would cost them CPU), else through httpx."""
        if self._channel.ack(tokens):
            return len(tokens)
        if self._raw.raw is not None:
            return _raw_ack(self._raw.raw, tokens, timeout)
        return int(self._post("/v1/fetch/ack", timeout, json={"tokens": tokens}).json()["released"])

    def release(self, ids, timeout):
        body = _release_body(ids)
        got = self._raw.release(body, timeout)
        if got is not None:
            return Released.from_json(got)
        return Released.from_json(self._post("/v1/release", timeout, content=body, headers=_SHM_HEADERS).json())

    def metadata(self, timeout):
        try:
            return _check(self._http.get("/v1/metadata", timeout=_timeout(timeout, self._connect_timeout_s))).json()
        except httpx.TransportError as exc:
            raise _transport_error(exc, self.base_url) from exc

    def close(self, acknowledge: bool = True):
        """`acknowledge` False: the pending acknowledgements are dropped (a server given up: their holds end
        at their lease)."""
        self.ipc_acks.close(send=acknowledge)  # what is pending goes first
        self._channel.close()
        self._raw.close()
        self._http.close()


class AsyncHttpTransport:
    """See HttpTransport."""

    def __init__(self, base_url: str, *, token: str | None = None, fetch_threads: int = READ_THREADS,
                 ipc_channel: bool = True, connect_timeout_s: float = CONNECT_TIMEOUT_S, **httpx_kw):
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(token), **httpx_kw)
        self._raw = _RawFetch(_raw(base_url, token, connect_timeout_s, httpx_kw))
        self._threads = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="encoder-fetch")
        self.base_url, self._connect_timeout_s = base_url.rstrip("/"), connect_timeout_s
        self.ipc_acks = Acks(lambda tokens: self.ack_ipc(tokens, ACK_TIMEOUT_S))
        self._channel = AsyncChannelLink(token, self.metadata)
        if not ipc_channel:
            self._channel.close()

    async def _post(self, path: str, timeout, **kw) -> httpx.Response:
        try:
            return _check(await self._http.post(path, timeout=_timeout(timeout, self._connect_timeout_s), **kw))
        except httpx.TransportError as exc:
            raise _transport_error(exc, self.base_url) from exc

    async def encode(self, images, wait, return_embeddings, timeout, ipc: dict | None = None):
        return _infos(await self._post("/v1/encode", timeout,
                                       **_encode_args(images, wait, return_embeddings, timeout, ipc)))

    async def encode_videos(self, videos, wait, return_embeddings, timeout):
        return _video_infos(await self._post("/v1/encode", timeout,
                                             **_encode_videos_args(videos, wait, return_embeddings, timeout)))

    async def fetch(self, items, start, end, dest: Destination, timeout):
        body = _fetch_body(items, start, end, timeout)
        if self._raw.raw is not None:
            got = await in_thread(self._threads, partial(self._raw.fetch, body, dest, timeout), dest)
            if got is not None:
                return got
        return _decoded(await self._post("/v1/fetch", timeout, content=body, headers=_FETCH_HEADERS), dest)

    async def fetch_shm(self, items, start, end, target, timeout):
        body = _fetch_body(items, start, end, timeout, target)
        if self._raw.raw is not None:
            got = await in_thread(self._threads, partial(self._raw.fetch_shm, body, timeout))
            if got is not None:
                return _shm_reply(got)
        return _shm_reply(await self._post("/v1/fetch", timeout, content=body, headers=_SHM_HEADERS))

    async def fetch_ipc(self, items, start, end, ipc: dict, timeout):
        got = await self._channel.fetch(items, start, end, ipc, _time_left(timeout))
        if got is not None:
            return got
        body = _fetch_body(items, start, end, timeout, ipc=ipc)
        if self._raw.raw is not None:
            got = await in_thread(self._threads, partial(self._raw.fetch_shm, body, timeout))
            if got is not None:
                return _ipc_reply(got)
        return _ipc_reply(await self._post("/v1/fetch", timeout, content=body, headers=_SHM_HEADERS))

    def ack_ipc(self, tokens: list[str], timeout) -> int:
        """Blocking (the client's acks thread calls it), on a plain socket; without one (https, a proxy) the
        tokens go only with later fetches (client/ipc.py: Acks), and the rest end at their lease."""
        return _raw_ack(self._raw.raw, tokens, timeout) if self._raw.raw is not None else 0

    async def release(self, ids, timeout):
        body = _release_body(ids)
        if self._raw.raw is not None:  # short: a thread of the plain socket path, not httpx's pool on the loop
            got = await in_thread(self._threads, partial(self._raw.release, body, timeout))
            if got is not None:
                return Released.from_json(got)
        return Released.from_json((await self._post("/v1/release", timeout, content=body,
                                                    headers=_SHM_HEADERS)).json())

    async def metadata(self, timeout):
        try:
            return _check(await self._http.get("/v1/metadata",
                                               timeout=_timeout(timeout, self._connect_timeout_s))).json()
        except httpx.TransportError as exc:
            raise _transport_error(exc, self.base_url) from exc

    async def close(self, acknowledge: bool = True):
        """See HttpTransport.close."""
        await asyncio.to_thread(self.ipc_acks.close, acknowledge)  # what is pending goes first (a blocking send)
        self._channel.close()
        self._raw.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        await self._http.aclose()
