"""The clients: argument handling, chunk iteration, shared-memory fetch. Transports only move bytes.

A transport (client/http.py, client/grpc_transport.py) implements, sync or async:
  encode(images: list[ImageSource], wait, return_embeddings, timeout) -> list[ImageInfo]
  fetch(items: list[(id, offset)], start, end, out, timeout) -> (WireHeader, rows)
  fetch_shm(items, start, end, target: {"name", "offset", "by_position"}, timeout) -> (WireHeader, shm_bytes)
  release(ids: list[str], timeout) -> int;  metadata(timeout) -> dict;  close()
With `shm=True` a client fetches through shared-memory files (client/shm.py) instead of the socket.
"""

from __future__ import annotations

import io
import os
from typing import AsyncIterator, Iterator, Sequence

import torch

from encoder_service.client.grpc_transport import AsyncGrpcTransport, GrpcTransport
from encoder_service.client.http import AsyncHttpTransport, HttpTransport
from encoder_service.client.shm import ShmBuffers, ShmFile
from encoder_service.client.types import FetchedRows, ImageInfo, ImageSource
from encoder_service.errors import InvalidInput
from encoder_service.protocol import wire
from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.shm import DEFAULT_DIR
from encoder_service.ranges import PromptLayout, chunks, overlapping


def image_source(image) -> ImageSource:
    """bytes, a path (str / PathLike), an http(s) URL string, a PIL image, or an ImageSource."""
    if isinstance(image, ImageSource):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        return ImageSource(data=bytes(image))
    if isinstance(image, str) and image.startswith(("http://", "https://")):
        return ImageSource(url=image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return ImageSource(data=f.read())
    if hasattr(image, "save") and hasattr(image, "mode"):  # PIL.Image, without importing PIL here
        buf = io.BytesIO()
        image.save(buf, format="PNG")  # lossless: the server sees exactly these pixels
        return ImageSource(data=buf.getvalue())
    raise InvalidInput(f"can't send an image of type {type(image).__name__} "
                       "(give bytes, a path, an http(s) URL, or a PIL image)")


def fetch_items(items) -> list[tuple[str, int]]:
    """(id, offset) pairs from (id, offset) or (id, offset, num_tokens) tuples."""
    return [(str(item[0]), int(item[1])) for item in items]


def _layout(layout) -> PromptLayout:
    return layout if isinstance(layout, PromptLayout) else PromptLayout(*layout)


def _plan(layout, chunk_size: int):
    """(start, end, overlapping items) per chunk: only images overlapping a chunk are fetched for it."""
    layout = _layout(layout)
    for start, end in chunks(layout.prompt_len, chunk_size):
        yield start, end, overlapping(layout.items, start, end)


def _result(start: int, end: int, fetched) -> FetchedRows:
    header, rows = fetched
    return FetchedRows(start, end, list(header.segments), rows, header.dtype, header.layout)


def _buffers(shm: bool, shm_dir: str) -> ShmBuffers | None:
    return ShmBuffers(shm_dir) if shm else None


def _ids(ids) -> list[str]:
    if isinstance(ids, str):
        raise InvalidInput("release takes a list of ids, got one string")
    return [str(i) for i in ids]


class _ShmFetch:
    """One fetch through shared memory: the target the server writes to, and how the rows reach the caller.

    `out` inside an alloc_rows file (CPU, contiguous, the payload's dtype and width, >= end - start rows):
    the server writes each segment at its row (by_position); nothing to copy here. Otherwise the packed
    rows land in a staging file: one copy into `out`, or into a new tensor when there is no `out`.
    """

    def __init__(self, buffers: ShmBuffers, out: torch.Tensor | None, start: int, end: int, dtype: str,
                 row_width: int):
        self._buffers, self._out, self._start, self._staging = buffers, out, start, None
        t = torch_dtype(dtype)
        direct = (out is not None and out.device.type == "cpu" and out.dtype == t and out.dim() == 2
                  and out.shape[1] == row_width and out.shape[0] >= end - start and out.is_contiguous())
        where = buffers.locate(out) if direct else None
        if where is not None:
            self.target = {"name": where[0], "offset": where[1], "by_position": True}
        else:
            self._staging = buffers.take_staging(max(1, end - start) * row_width * t.itemsize)
            self.target = {"name": self._staging.name, "offset": 0, "by_position": False}

    def finish(self, header: wire.WireHeader, shm_bytes: int) -> torch.Tensor:
        if shm_bytes != header.payload_bytes:
            raise wire.WireError(f"the server wrote {shm_bytes} bytes into shared memory, its header announces "
                                 f"{header.payload_bytes} (does it predate shared-memory fetch?)")
        if self._staging is None:
            if torch_dtype(header.dtype) != self._out.dtype:
                raise wire.WireError(f"the server wrote {header.dtype} rows into a {self._out.dtype} buffer")
            wire.check_out(header, self._out, self._start)
            return self._out
        f: ShmFile = self._staging
        if header.payload_bytes > f.size:
            raise wire.WireError(f"the header announces {header.payload_bytes} row bytes, over the "
                                 f"{f.size}-byte staging file")
        rows = f.data[:header.payload_bytes].view(torch_dtype(header.dtype)).view(header.num_rows, header.row_width)
        return rows.clone() if self._out is None else wire.place_rows(header, rows, self._out, self._start)

    def close(self, ok: bool) -> None:
        """After a failed fetch (a timeout, say) the server may still be writing into the staging file:
        it is dropped, not reused."""
        if self._staging is not None:
            self._buffers.give_staging(self._staging, reuse=ok)
            self._staging = None


def _need_shm(shm: ShmBuffers | None) -> ShmBuffers:
    if shm is None:
        raise InvalidInput("alloc_rows needs a client built with shm=True")
    return shm


class EncoderClient:
    """Blocking client. Build with EncoderClient.http(url) or EncoderClient.grpc(target).

    `shm=True` (server on this host with --shm-fetch, sharing `shm_dir`): fetches come back through
    shared-memory files the client owns, not the socket; a server with shm fetch off answers
    FailedPrecondition (no silent fallback). `alloc_rows` gives buffers the server writes into directly.
    """

    def __init__(self, transport, timeout: float | None = 60.0, shm: ShmBuffers | None = None):
        self._transport, self.timeout, self._shm = transport, timeout, shm
        self._geometry: tuple[str, int] | None = None  # (dtype, row_width) of the server's rows

    @classmethod
    def http(cls, base_url: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, **kw):
        return cls(HttpTransport(base_url, token=token, **kw), timeout, _buffers(shm, shm_dir))

    @classmethod
    def grpc(cls, target: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, **kw):
        return cls(GrpcTransport(target, token=token, **kw), timeout, _buffers(shm, shm_dir))

    def alloc_rows(self, num_rows: int, row_width: int, dtype: torch.dtype | str) -> torch.Tensor:
        """[num_rows, row_width] zeros in shared memory: as fetch `out` (or a row slice of it, as in
        iter_chunks(out=lambda s, e: buf[s:e])) the server writes the rows straight into it. After a fetch
        into it fails (a timeout, say), the server may still write that chunk's rows there for a moment."""
        return _need_shm(self._shm).alloc_rows(num_rows, row_width, dtype)

    def encode(self, images: Sequence, wait: bool = False, return_embeddings: bool = False) -> list[ImageInfo]:
        return self._transport.encode([image_source(i) for i in images], wait, return_embeddings, self.timeout)

    def fetch(self, items, start: int, end: int, out: torch.Tensor | None = None) -> FetchedRows:
        if self._shm is None:
            return _result(start, end, self._transport.fetch(fetch_items(items), start, end, out, self.timeout))
        if self._geometry is None:
            meta = self.metadata()
            self._geometry = (meta["dtype"], int(meta["row_width"]))
        plan, ok = _ShmFetch(self._shm, out, start, end, *self._geometry), False
        try:
            header, shm_bytes = self._transport.fetch_shm(fetch_items(items), start, end, plan.target, self.timeout)
            result = _result(start, end, (header, plan.finish(header, shm_bytes)))
            ok = True
            return result
        finally:
            plan.close(ok)

    def release(self, ids) -> int:
        """End the encode pins of `ids` early (done with them); returns how many had one. Entries stay cached."""
        return self._transport.release(_ids(ids), self.timeout)

    def iter_chunks(self, layout, chunk_size: int, out=None) -> Iterator[FetchedRows]:
        """Per chunk of `layout` ((items, prompt_len) or PromptLayout), the rows it needs.

        `out(start, end)`, if given, returns the buffer for that chunk's rows. Text-only chunks cost no
        request and come with no segments and `rows` None (or their untouched `out`).
        """
        for start, end, items in _plan(layout, chunk_size):
            buf = out(start, end) if out is not None else None
            if items:
                yield self.fetch(items, start, end, buf)
            else:
                yield FetchedRows(start, end, [], buf)

    def metadata(self) -> dict:
        return self._transport.metadata(self.timeout)

    def close(self) -> None:
        try:
            self._transport.close()
        finally:
            if self._shm is not None:
                self._shm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncEncoderClient:
    """asyncio client, same methods as EncoderClient (shm too). Build with AsyncEncoderClient.http / .grpc."""

    def __init__(self, transport, timeout: float | None = 60.0, shm: ShmBuffers | None = None):
        self._transport, self.timeout, self._shm = transport, timeout, shm
        self._geometry: tuple[str, int] | None = None

    @classmethod
    def http(cls, base_url: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, **kw):
        return cls(AsyncHttpTransport(base_url, token=token, **kw), timeout, _buffers(shm, shm_dir))

    @classmethod
    def grpc(cls, target: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, **kw):
        return cls(AsyncGrpcTransport(target, token=token, **kw), timeout, _buffers(shm, shm_dir))

    def alloc_rows(self, num_rows: int, row_width: int, dtype: torch.dtype | str) -> torch.Tensor:
        """See EncoderClient.alloc_rows (no I/O: not a coroutine)."""
        return _need_shm(self._shm).alloc_rows(num_rows, row_width, dtype)

    async def encode(self, images: Sequence, wait: bool = False, return_embeddings: bool = False
                     ) -> list[ImageInfo]:
        return await self._transport.encode([image_source(i) for i in images], wait, return_embeddings,
                                            self.timeout)

    async def fetch(self, items, start: int, end: int, out: torch.Tensor | None = None) -> FetchedRows:
        if self._shm is None:
            return _result(start, end, await self._transport.fetch(fetch_items(items), start, end, out,
                                                                   self.timeout))
        if self._geometry is None:
            meta = await self.metadata()
            self._geometry = (meta["dtype"], int(meta["row_width"]))
        plan, ok = _ShmFetch(self._shm, out, start, end, *self._geometry), False
        try:
            header, shm_bytes = await self._transport.fetch_shm(fetch_items(items), start, end, plan.target,
                                                                 self.timeout)
            result = _result(start, end, (header, plan.finish(header, shm_bytes)))
            ok = True
            return result
        finally:
            plan.close(ok)

    async def release(self, ids) -> int:
        """See EncoderClient.release."""
        return await self._transport.release(_ids(ids), self.timeout)

    async def iter_chunks(self, layout, chunk_size: int, out=None) -> AsyncIterator[FetchedRows]:
        """See EncoderClient.iter_chunks."""
        for start, end, items in _plan(layout, chunk_size):
            buf = out(start, end) if out is not None else None
            if items:
                yield await self.fetch(items, start, end, buf)
            else:
                yield FetchedRows(start, end, [], buf)

    async def metadata(self) -> dict:
        return await self._transport.metadata(self.timeout)

    async def close(self) -> None:
        try:
            await self._transport.close()
        finally:
            if self._shm is not None:
                self._shm.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
