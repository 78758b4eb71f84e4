"""HTTP transports (httpx, blocking and async) for EncoderClient / AsyncEncoderClient.

Encode sends multipart (raw bytes, field `image`) unless an image is a URL or carries a caller id, which
only the JSON form (base64) can say. Fetch asks for the octet-stream payload (protocol/wire.py); an shm
fetch gets a JSON header (the rows are in the client's file).
"""

from __future__ import annotations

import base64

import httpx

from encoder_service.client.types import ImageInfo, ImageSource
from encoder_service.client.errors import remote_error
from encoder_service.errors import DeadlineExceeded, Unavailable
from encoder_service.protocol import wire


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _encode_args(images: list[ImageSource], wait: bool, return_embeddings: bool, timeout) -> dict:
    """httpx.request keyword arguments for POST /v1/encode."""
    if all(i.data is not None and i.caller_id is None for i in images):
        params = {"wait": str(wait).lower(), "return_embeddings": str(return_embeddings).lower()}
        if timeout is not None:
            params["timeout_s"] = str(timeout)
        return {"files": [("image", (f"image{k}", i.data, "application/octet-stream")) for k, i in enumerate(images)],
                "params": params}
    body = {"images": [({"data": base64.b64encode(i.data).decode("ascii")} if i.data is not None else {"url": i.url})
                       | ({"id": i.caller_id} if i.caller_id else {}) for i in images],
            "wait": wait, "return_embeddings": return_embeddings, "timeout_s": timeout}
    return {"json": body}


def _infos(response: httpx.Response) -> list[ImageInfo]:
    return [ImageInfo.from_json(d, embedding=_embedding(d) if "embedding" in d else None)
            for d in response.json()["images"]]


def _embedding(d: dict):
    e = d["embedding"]
    return wire.rows_from_bytes(base64.b64decode(e["data"]), e["dtype"], int(e["shape"][1]), int(e["shape"][0]))


def _fetch_json(items, start: int, end: int, timeout, shm: dict | None = None) -> dict:
    body = {"items": [{"id": i, "offset": o} for i, o in items], "start": start, "end": end, "timeout_s": timeout}
    return body | {"shm": shm} if shm is not None else body


def _shm_reply(response: httpx.Response) -> tuple[wire.WireHeader, int]:
    """(header, shm_bytes) of an shm fetch's JSON answer."""
    try:
        d = response.json()
        return wire.WireHeader.from_dict(d), int(d["shm_bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise wire.WireError(f"not an shm fetch answer ({response.headers.get('content-type')}): {exc!r}") from None


def _check(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    try:
        err = response.json().get("error")
    except (ValueError, AttributeError):  # not our JSON (a proxy's page): the status decides the type
        err = None
    err = err if isinstance(err, dict) else {}
    retry = err.get("retry_after_s")
    if retry is None and "retry-after" in response.headers:
        retry = float(response.headers["retry-after"])
    raise remote_error(err.get("kind"), err.get("message") or response.text[:500], response.status_code, retry)


def _transport_error(exc: httpx.TransportError):
    """Network trouble in the service's own terms: a timeout or an unreachable server."""
    if isinstance(exc, httpx.TimeoutException):
        return DeadlineExceeded(f"HTTP request timed out: {exc!r}")
    return Unavailable(f"HTTP request failed: {exc!r}")


class HttpTransport:
    def __init__(self, base_url: str, *, token: str | None = None, **httpx_kw):
        self._http = httpx.Client(base_url=base_url, headers=_headers(token), **httpx_kw)

    def _post(self, path: str, timeout, **kw) -> httpx.Response:
        try:
            return _check(self._http.post(path, timeout=timeout, **kw))
        except httpx.TransportError as exc:
            raise _transport_error(exc) from exc

    def encode(self, images, wait, return_embeddings, timeout):
        return _infos(self._post("/v1/encode", timeout, **_encode_args(images, wait, return_embeddings, timeout)))

    def fetch(self, items, start, end, out, timeout):
        response = self._post("/v1/fetch", timeout, json=_fetch_json(items, start, end, timeout),
                              headers={"accept": "application/octet-stream"})
        return wire.decode_http(response.content, out, start)

    def fetch_shm(self, items, start, end, target, timeout):
        return _shm_reply(self._post("/v1/fetch", timeout, json=_fetch_json(items, start, end, timeout, target)))

    def release(self, ids, timeout):
        return int(self._post("/v1/release", timeout, json={"ids": ids}).json()["released"])

    def metadata(self, timeout):
        try:
            return _check(self._http.get("/v1/metadata", timeout=timeout)).json()
        except httpx.TransportError as exc:
            raise _transport_error(exc) from exc

    def close(self):
        self._http.close()


class AsyncHttpTransport:
    def __init__(self, base_url: str, *, token: str | None = None, **httpx_kw):
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(token), **httpx_kw)

    async def _post(self, path: str, timeout, **kw) -> httpx.Response:
        try:
            return _check(await self._http.post(path, timeout=timeout, **kw))
        except httpx.TransportError as exc:
            raise _transport_error(exc) from exc

    async def encode(self, images, wait, return_embeddings, timeout):
        return _infos(await self._post("/v1/encode", timeout,
                                       **_encode_args(images, wait, return_embeddings, timeout)))

    async def fetch(self, items, start, end, out, timeout):
        response = await self._post("/v1/fetch", timeout, json=_fetch_json(items, start, end, timeout),
                                    headers={"accept": "application/octet-stream"})
        return wire.decode_http(response.content, out, start)

    async def fetch_shm(self, items, start, end, target, timeout):
        return _shm_reply(await self._post("/v1/fetch", timeout,
                                           json=_fetch_json(items, start, end, timeout, target)))

    async def release(self, ids, timeout):
        return int((await self._post("/v1/release", timeout, json={"ids": ids})).json()["released"])

    async def metadata(self, timeout):
        try:
            return _check(await self._http.get("/v1/metadata", timeout=timeout)).json()
        except httpx.TransportError as exc:
            raise _transport_error(exc) from exc

    async def close(self):
        await self._http.aclose()
