"""What the clients share: argument handling, results, chunk iteration. Transports only move bytes.

A transport (client/http.py, client/grpc_transport.py) implements, sync or async:
  encode(images: list[ImageSource], wait, return_embeddings, timeout) -> list[ImageInfo]
  fetch(items: list[(id, offset)], start, end, out, timeout) -> (WireHeader, rows)
  metadata(timeout) -> dict;  close()
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import torch

from encoder_service.errors import InvalidInput
from encoder_service.ranges import PromptLayout, Segment, chunks, overlapping


@dataclass(frozen=True)
class ImageSource:
    """One image as sent: exactly one of `data` (encoded file bytes) or `url`."""

    data: bytes | None = None
    url: str | None = None
    caller_id: str | None = None


@dataclass(frozen=True)
class ImageInfo:
    id: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    row_width: int
    hidden_size: int
    layout: str
    dtype: str
    cached: bool
    embedding: torch.Tensor | None = field(default=None, repr=False)  # with return_embeddings


@dataclass(frozen=True)
class FetchedRows:
    """Rows of one chunk [start, end). `rows` is the caller's `out` (rows at position - start) when one
    was given, else the packed [sum of segment rows, row_width] tensor in segment order."""

    start: int
    end: int
    segments: list[Segment]
    rows: torch.Tensor | None
    dtype: str | None = None
    layout: str | None = None


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


class EncoderClient:
    """Blocking client. Build with EncoderClient.http(url) or EncoderClient.grpc(target)."""

    def __init__(self, transport, timeout: float | None = 60.0):
        self._transport, self.timeout = transport, timeout

    @classmethod
    def http(cls, base_url: str, *, token: str | None = None, timeout: float | None = 60.0, **kw):
        from encoder_service.client.http import HttpTransport

        return cls(HttpTransport(base_url, token=token, **kw), timeout)

    @classmethod
    def grpc(cls, target: str, *, token: str | None = None, timeout: float | None = 60.0, **kw):
        from encoder_service.client.grpc_transport import GrpcTransport

        return cls(GrpcTransport(target, token=token, **kw), timeout)

    def encode(self, images: Sequence, wait: bool = False, return_embeddings: bool = False) -> list[ImageInfo]:
        return self._transport.encode([image_source(i) for i in images], wait, return_embeddings, self.timeout)

    def fetch(self, items, start: int, end: int, out: torch.Tensor | None = None) -> FetchedRows:
        return _result(start, end, self._transport.fetch(fetch_items(items), start, end, out, self.timeout))

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
        self._transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncEncoderClient:
    """asyncio client, same methods as EncoderClient. Build with AsyncEncoderClient.http / .grpc."""

    def __init__(self, transport, timeout: float | None = 60.0):
        self._transport, self.timeout = transport, timeout

    @classmethod
    def http(cls, base_url: str, *, token: str | None = None, timeout: float | None = 60.0, **kw):
        from encoder_service.client.http import AsyncHttpTransport

        return cls(AsyncHttpTransport(base_url, token=token, **kw), timeout)

    @classmethod
    def grpc(cls, target: str, *, token: str | None = None, timeout: float | None = 60.0, **kw):
        from encoder_service.client.grpc_transport import AsyncGrpcTransport

        return cls(AsyncGrpcTransport(target, token=token, **kw), timeout)

    async def encode(self, images: Sequence, wait: bool = False, return_embeddings: bool = False
                     ) -> list[ImageInfo]:
        return await self._transport.encode([image_source(i) for i in images], wait, return_embeddings,
                                            self.timeout)

    async def fetch(self, items, start: int, end: int, out: torch.Tensor | None = None) -> FetchedRows:
        return _result(start, end, await self._transport.fetch(fetch_items(items), start, end, out, self.timeout))

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
        await self._transport.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
