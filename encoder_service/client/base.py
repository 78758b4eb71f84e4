"""The clients: argument handling, chunk iteration, shared-memory fetch. Transports only move bytes.

A transport (client/http.py, client/grpc_transport.py) implements, sync or async:
  encode(images: list[ImageSource], wait, return_embeddings, timeout) -> list[ImageInfo]
  encode_videos(videos: list[VideoSource], wait, return_embeddings, timeout) -> list[VideoInfo]
  fetch(items: list[(id, offset)], start, end, dest: Destination, timeout) -> (WireHeader, rows)
  fetch_shm(items, start, end, target: {"name", "offset", "by_position"}, timeout) -> (WireHeader, shm_bytes)
  release(ids: list[str], timeout) -> Released (protocol/release.py);  metadata(timeout) -> dict;  close()
With `shm=True` a client fetches through shared-memory files (client/shm.py) instead of the socket. A fetch
into a CUDA `out` from a server on this host with IPC on goes GPU to GPU first (client/ipc.py; HTTP clients,
`ipc="auto"`), then the way above. `fetch_paths` counts the fetches each way went ("ipc", "shm", "socket").
Calls that fail with 503 / UNAVAILABLE or an unreachable server are tried again within the client's timeout
(`retry`: client/retry.py; None: never).

A socket fetch into a large `out` is split by prompt position into up to `fetch_streams` fetches of at
least SPLIT_BYTES each, run at once on their own connections (one TCP stream tops out near 3 GB/s on
loopback, several add up): each writes its rows into its own rows of `out`, and the answer is the one an
unsplit fetch gives (segments cut at the split points are joined again).
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Iterator, Sequence

import torch

from encoder_service.client.destination import Destination, StagingBuffers
from encoder_service.client.grpc_transport import AsyncGrpcTransport, GrpcTransport
from encoder_service.client.http import AsyncHttpTransport, HttpTransport
from encoder_service.client.ipc import IpcPath, held_request
from encoder_service.client.ipc_route import IpcAnswer, IpcRoute
from encoder_service.client.owners import AsyncOwnerRouting, OwnerRouting
from encoder_service.client.retry import DEFAULT_RETRY, AsyncRetrying, Retrying, RetryPolicy
from encoder_service.client.shm import ShmBuffers, ShmFile
from encoder_service.client.types import FetchedRows, ImageInfo, ImageSource, ReleaseCount, VideoInfo, VideoSource
from encoder_service.errors import InvalidInput
from encoder_service.protocol import wire
from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.ipc import IpcPlacement
from encoder_service.protocol.shm import DEFAULT_DIR
from encoder_service.ranges import PromptLayout, Segment, chunks, overlapping
from encoder_service.rowpath.host_pool import HostRowPool

FETCH_STREAMS = 4  # at most this many connections for one fetch
SPLIT_BYTES = 16 << 20  # and at least this many bytes of `out` for each
_UNKNOWN = object()  # the server's IPC metadata, not asked yet


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


def video_source(video, **options) -> VideoSource:
    """bytes (a container file), a path, an http(s) URL string, a list of frames (each bytes, a path or a PIL
    image), or a VideoSource (sent as it is). `options` (fps, num_frames, ...: VideoSource's) go with the rest."""
    if isinstance(video, VideoSource):
        return video
    if isinstance(video, (list, tuple)):
        frames = tuple(image_source(frame).data for frame in video)
        if any(frame is None for frame in frames):
            raise InvalidInput("a video's frames are images given inline (bytes, paths or PIL images), not URLs")
        return VideoSource(frames=frames, **options)
    if isinstance(video, (bytes, bytearray, memoryview)):
        return VideoSource(data=bytes(video), **options)
    if isinstance(video, str) and video.startswith(("http://", "https://")):
        return VideoSource(url=video, **options)
    if isinstance(video, (str, os.PathLike)):
        with open(video, "rb") as f:
            return VideoSource(data=f.read(), **options)
    raise InvalidInput(f"can't send a video of type {type(video).__name__} "
                       "(give bytes, a path, an http(s) URL, or a list of frames)")


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


def split_points(start: int, end: int, out: torch.Tensor | None, streams: int) -> list[tuple[int, int]]:
    """[start, end) cut into equal position ranges, one per stream: as many streams as `out` has
    SPLIT_BYTES for (up to `streams`); one range without `out` (a packed answer can't be cut ahead)."""
    if out is None or out.dim() != 2 or end - start < 2:
        return [(start, end)]
    n = max(1, min(streams, end - start, (end - start) * out.shape[1] * out.element_size() // SPLIT_BYTES))
    bounds = [start + (end - start) * k // n for k in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def joined(start: int, end: int, parts: list[FetchedRows], out: torch.Tensor) -> FetchedRows:
    """The answer of the unsplit fetch from its parts' (in position order): an image's segments cut at a
    split point are one segment again."""
    segments: list[Segment] = []
    for s in (s for part in parts for s in part.segments):
        prev = segments[-1] if segments else None
        if prev and prev.id == s.id and prev.row_end == s.row_start and prev.position + prev.num_rows == s.position:
            segments[-1] = Segment(s.id, prev.position, prev.row_start, s.row_end)
        else:
            segments.append(s)
    return FetchedRows(start, end, segments, out, parts[0].dtype, parts[0].layout)


def _part_out(out: torch.Tensor | None, start: int, lo: int, hi: int) -> torch.Tensor | None:
    return None if out is None else out[lo - start:hi - start]


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
    rows land in a staging file: one copy into `out`, or into memory of `rows` when there is no `out`.
    """

    def __init__(self, buffers: ShmBuffers, rows: HostRowPool, out: torch.Tensor | None, start: int, end: int,
                 dtype: str, row_width: int):
        self._buffers, self._rows, self._out, self._start, self._staging = buffers, rows, out, start, None
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
        dtype = torch_dtype(header.dtype)
        rows = f.data[:header.payload_bytes].view(dtype).view(header.num_rows, header.row_width)
        if self._out is not None:
            return wire.place_rows(header, rows, self._out, self._start)
        return self._rows.take(header.payload_bytes).view(dtype).view(rows.shape).copy_(rows)

    def close(self, ok: bool) -> None:
        """After a failed fetch (a timeout, say) the server may still be writing into the staging file:
        it is dropped, not reused."""
        if self._staging is not None:
            self._buffers.give_staging(self._staging, reuse=ok)
            self._staging = None


def _ipc_path(transport, ipc) -> IpcPath | None:
    """The client's fetch by IPC: "auto" (a CUDA reader once a CUDA `out` comes), "off", or a reader (the CPU
    tests' host stand-in, encoder_service/testing/host_ipc.py); None on transports without it (gRPC)."""
    if ipc == "off" or ipc is False or getattr(transport, "fetch_ipc", None) is None:
        return None
    return IpcPath(None if ipc == "auto" else ipc)


def _encode_ipc(path: IpcPath | None, meta, transport) -> dict:
    """{"ipc": the request} when an encode may ask for its rows by IPC (`meta`: the server's "ipc"), else {};
    the acknowledgements it carries are taken from the server's (`_restore` them when the encode fails)."""
    if path is None or not path.may_hold(meta):
        return {}
    return {"ipc": held_request(transport.ipc_acks.take())}


def _restore(ipc: dict, transport) -> None:
    """An encode carrying `ipc` (_encode_ipc) failed: its acknowledgements go with a later request."""
    if ipc:
        transport.ipc_acks.restore(ipc["ipc"].get("ack", ()))


def _whole(info: ImageInfo) -> wire.WireHeader:
    """The header of a fetch of all of `info`'s rows at prompt row 0 (what an encode's hold places)."""
    return wire.WireHeader(info.dtype, info.row_width, info.layout, (Segment(info.id, 0, 0, info.num_tokens),))


def _release_hold(info: ImageInfo, acks) -> None:
    """A hold this client will not copy under (its `out` is not one IPC fills): acknowledged at once."""
    if isinstance(info.ipc, IpcPlacement) and info.ipc.token is not None:
        acks.add(info.ipc.token)


def _copy_held(path: IpcPath | None, meta, info: ImageInfo, out: torch.Tensor, transport) -> bool:
    """Whether to copy `info`'s rows into `out` under the hold its encode answer carries (then IpcPath.finish);
    a hold that will not be used is acknowledged at once."""
    if path is None or info.ipc is None:
        return False
    if not path.wants(out, meta):
        _release_hold(info, transport.ipc_acks)
        return False
    return True


def _finish_args(got: IpcAnswer, out: torch.Tensor, start: int) -> tuple:
    """IpcPath.finish's arguments for the answer a route got (client/ipc_route.py)."""
    return got.header, got.answer, out, start, got.sent, got.transport.ipc_acks, got.server


def _need_shm(shm: ShmBuffers | None) -> ShmBuffers:
    if shm is None:
        raise InvalidInput("alloc_rows needs a client built with shm=True")
    return shm


class _Client:
    """What both clients share that does no I/O."""

    _ipc: IpcPath | None
    fetch_paths: Counter[str]

    def _by_ipc(self, copied: torch.Tensor | None) -> bool:
        """Whether rows came by IPC (IpcPath.finish's answer), counted."""
        if copied is None:
            return False
        self.fetch_paths["ipc"] += 1
        return True

    def _fetched_by_ipc(self, start: int, end: int, got: IpcAnswer, copied: torch.Tensor | None) -> FetchedRows | None:
        return _result(start, end, (got.header, copied)) if self._by_ipc(copied) else None

    @property
    def ipc_off(self) -> str | None:
        """Why this client does not fetch by IPC (a refused open, gRPC), None while it may."""
        return "ipc=\"off\", or a gRPC client (the fetch by IPC is HTTP only)" if self._ipc is None else self._ipc.off


class EncoderClient(_Client):
    """Blocking client. Build with EncoderClient.http(url) or EncoderClient.grpc(target).

    `shm=True` (server on this host with --shm-fetch, sharing `shm_dir`): fetches come back through
    shared-memory files the client owns, not the socket; a server with shm fetch off answers
    FailedPrecondition (no silent fallback). `alloc_rows` gives buffers the server writes into directly.
    """

    def __init__(self, transport, timeout: float | None = 60.0, shm: ShmBuffers | None = None,
                 fetch_streams: int = FETCH_STREAMS, retry: RetryPolicy | None = DEFAULT_RETRY, ipc="auto"):
        self._transport = transport if retry is None else Retrying(transport, retry)
        self._routing = transport if isinstance(transport, OwnerRouting) else None  # fetches to the ids' owner
        self.timeout, self._shm = timeout, shm
        self.fetch_streams = fetch_streams
        self._geometry: tuple[str, int] | None = None  # (dtype, row_width) of the server's rows
        self._ipc, self._ipc_meta = _ipc_path(transport, ipc), _UNKNOWN
        self.fetch_paths: Counter[str] = Counter()
        self._staging_buffers = StagingBuffers()
        self._row_pool = HostRowPool()  # the rows of fetches without `out` (client/destination.py)
        self._threads: ThreadPoolExecutor | None = None  # the extra streams of split fetches (made on first use)
        self._threads_lock = threading.Lock()  # fetch may be called from several threads

    @classmethod
    def http(cls, base_url: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, fetch_streams: int = FETCH_STREAMS,
             retry: RetryPolicy | None = DEFAULT_RETRY, ipc="auto", follow_owner: bool = True, **kw):
        """`follow_owner`: fetch straight from the replica an encode answer named as the rows' owner, when it
        answers (client/owners.py); off: every fetch goes to `base_url`."""
        transport = HttpTransport(base_url, token=token, **kw)
        if follow_owner:
            transport = OwnerRouting(transport, lambda url: HttpTransport(url, token=token, **kw), base_url)
        return cls(transport, timeout, _buffers(shm, shm_dir), fetch_streams, retry, ipc)

    @classmethod
    def grpc(cls, target: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, fetch_streams: int = FETCH_STREAMS,
             retry: RetryPolicy | None = DEFAULT_RETRY, **kw):
        return cls(GrpcTransport(target, token=token, **kw), timeout, _buffers(shm, shm_dir), fetch_streams,
                   retry)

    def alloc_rows(self, num_rows: int, row_width: int, dtype: torch.dtype | str) -> torch.Tensor:
        """[num_rows, row_width] zeros in shared memory: as fetch `out` (or a row slice of it, as in
        iter_chunks(out=lambda s, e: buf[s:e])) the server writes the rows straight into it. After a fetch
        into it fails (a timeout, say), the server may still write that chunk's rows there for a moment."""
        return _need_shm(self._shm).alloc_rows(num_rows, row_width, dtype)

    def encode(self, images: Sequence, wait: bool = False, return_embeddings: bool = False,
               out=None) -> list[ImageInfo]:
        """`out`: a function of each image's answer (ImageInfo) giving the tensor its rows go into, as fetch's
        `out` ([>= num_tokens, row_width]); implies wait. When the server can place them for this client (a
        CUDA `out`, IPC on this host: client/ipc.py) the encode's answer carries each image's hold, and its
        rows are copied GPU to GPU with no request of their own; the others are fetched as `fetch` would."""
        sources = [image_source(i) for i in images]
        if out is None:
            return self._transport.encode(sources, wait, return_embeddings, self.timeout)
        if self._ipc is not None and self._ipc_meta is _UNKNOWN:
            self._ipc_meta = self.metadata().get("ipc")
        ipc, t = _encode_ipc(self._ipc, self._ipc_meta, self._transport), self._transport
        sent = time.monotonic()
        try:
            infos = t.encode(sources, True, return_embeddings, self.timeout, **ipc)
        except BaseException:
            _restore(ipc, t)
            raise
        for info in infos:
            rows = out(info)
            held = ipc and _copy_held(self._ipc, self._ipc_meta, info, rows, t)
            if not (held and self._by_ipc(self._ipc.finish(_whole(info), info.ipc, rows, 0, sent, t.ipc_acks,
                                                            t.base_url))):
                self.fetch([(info.id, 0)], 0, info.num_tokens, out=rows)
        return infos

    def encode_videos(self, videos: Sequence, wait: bool = False, return_embeddings: bool = False,
                      **options) -> list[VideoInfo]:
        """Videos (see `video_source`; `options`: fps, num_frames, sample_frames, min_pixels, max_pixels,
        frames_fps for those not given as VideoSource). Fetch a video's rows by its frame groups:
        `info.fetch_items(offset)` (one run, Qwen2/2.5-VL) or `info.fetch_items(offsets=...)` (Qwen3-VL)."""
        return self._transport.encode_videos([video_source(v, **options) for v in videos], wait, return_embeddings,
                                             self.timeout)

    def fetch(self, items, start: int, end: int, out: torch.Tensor | None = None) -> FetchedRows:
        """The rows of `items` ((id, offset) pairs) in chunk [start, end). `out` ([>= end - start, row_width],
        any dtype, CPU or CUDA) gets each segment's rows at row position - start, and is the answer's rows.
        After a fetch into `out` fails or is cancelled, a stream may still write its rows there for a moment.
        Without `out` the rows are a tensor of their own, on host memory this client reuses once every view
        of an answer's rows is dropped: drop them when done, and the next fetch skips fresh pages' faults."""
        items = fetch_items(items)
        if self._ipc is not None and out is not None and self._ipc.candidate(out):
            got = self._fetch_ipc(items, start, end, out)
            if got is not None:
                return got
        self.fetch_paths["shm" if self._shm is not None else "socket"] += 1
        if self._shm is None:
            parts = split_points(start, end, out, self.fetch_streams)
            if len(parts) == 1:
                return self._fetch_part(items, start, end, out)
            with self._threads_lock:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(max_workers=4 * self.fetch_streams,
                                                       thread_name_prefix="encoder-fetch")
            rest = [self._threads.submit(self._fetch_part, items, lo, hi, _part_out(out, start, lo, hi))
                    for lo, hi in parts[1:]]
            try:
                first = self._fetch_part(items, *parts[0], _part_out(out, start, *parts[0]))
            finally:  # every stream ends before we answer (or raise): none writes into `out` afterwards
                done = [f.exception() or f.result() for f in rest]
            for d in done:
                if isinstance(d, BaseException):
                    raise d
            return joined(start, end, [first, *done], out)
        if self._geometry is None:
            meta = self.metadata()
            self._geometry = (meta["dtype"], int(meta["row_width"]))
        plan, ok = _ShmFetch(self._shm, self._row_pool, out, start, end, *self._geometry), False
        try:
            header, shm_bytes = self._transport.fetch_shm(items, start, end, plan.target, self.timeout)
            result = _result(start, end, (header, plan.finish(header, shm_bytes)))
            ok = True
            return result
        finally:
            plan.close(ok)

    def _fetch_part(self, items, start: int, end: int, out: torch.Tensor | None) -> FetchedRows:
        with Destination(out, start, self._staging_buffers, self._row_pool) as dest:
            return _result(start, end, self._transport.fetch(items, start, end, dest, self.timeout))

    def _fetch_ipc(self, items, start: int, end: int, out: torch.Tensor) -> FetchedRows | None:
        """The rows GPU to GPU (client/ipc.py), or None: fetch them the next way. Sent where client/ipc_route.py
        says (the ids' owner when one is known, else the Service, which may name it); the hold's token goes
        back to the server that held the rows."""
        if self._ipc_meta is _UNKNOWN:
            self._ipc_meta = self.metadata().get("ipc")
        if not self._ipc.wants(out, self._ipc_meta):
            return None
        got = IpcRoute(self._transport, self._routing, items, self.timeout).run(start, end)
        return self._fetched_by_ipc(start, end, got, self._ipc.finish(*_finish_args(got, out, start)))

    def release(self, ids) -> ReleaseCount:
        """End the encode pins of `ids` early (done with them); returns how many had one (an int), whose
        `invalid` lists the malformed ids sent, each with why: those were not released, the others were.
        Entries stay cached."""
        return ReleaseCount(self._transport.release(_ids(ids), self.timeout))

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
            if self._threads is not None:
                self._threads.shutdown(wait=True)
            if self._ipc is not None:
                self._ipc.close()  # its last acknowledgements first
            self._transport.close()
        finally:
            self._staging_buffers.close()
            self._row_pool.close()
            if self._shm is not None:
                self._shm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncEncoderClient(_Client):
    """asyncio client, same methods as EncoderClient (shm too). Build with AsyncEncoderClient.http / .grpc."""

    def __init__(self, transport, timeout: float | None = 60.0, shm: ShmBuffers | None = None,
                 fetch_streams: int = FETCH_STREAMS, retry: RetryPolicy | None = DEFAULT_RETRY, ipc="auto"):
        self._transport = transport if retry is None else AsyncRetrying(transport, retry)
        self._routing = transport if isinstance(transport, AsyncOwnerRouting) else None
        self.timeout, self._shm = timeout, shm
        self.fetch_streams = fetch_streams
        self._geometry: tuple[str, int] | None = None
        self._ipc, self._ipc_meta = _ipc_path(transport, ipc), _UNKNOWN
        self.fetch_paths: Counter[str] = Counter()
        self._staging_buffers = StagingBuffers()
        self._row_pool = HostRowPool()

    @classmethod
    def http(cls, base_url: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, fetch_streams: int = FETCH_STREAMS,
             retry: RetryPolicy | None = DEFAULT_RETRY, ipc="auto", follow_owner: bool = True, **kw):
        """`follow_owner`: as EncoderClient.http's."""
        transport = AsyncHttpTransport(base_url, token=token, **kw)
        if follow_owner:
            transport = AsyncOwnerRouting(transport, lambda url: AsyncHttpTransport(url, token=token, **kw), base_url)
        return cls(transport, timeout, _buffers(shm, shm_dir), fetch_streams, retry, ipc)

    @classmethod
    def grpc(cls, target: str, *, token: str | None = None, timeout: float | None = 60.0, shm: bool = False,
             shm_dir: str = DEFAULT_DIR, fetch_streams: int = FETCH_STREAMS,
             retry: RetryPolicy | None = DEFAULT_RETRY, **kw):
        return cls(AsyncGrpcTransport(target, token=token, **kw), timeout, _buffers(shm, shm_dir), fetch_streams,
                   retry)

    def alloc_rows(self, num_rows: int, row_width: int, dtype: torch.dtype | str) -> torch.Tensor:
        """See EncoderClient.alloc_rows (no I/O: not a coroutine)."""
        return _need_shm(self._shm).alloc_rows(num_rows, row_width, dtype)

    async def encode(self, images: Sequence, wait: bool = False, return_embeddings: bool = False,
                     out=None) -> list[ImageInfo]:
        """See EncoderClient.encode (the copies and their synchronization on a thread, off the loop)."""
        sources = [image_source(i) for i in images]
        if out is None:
            return await self._transport.encode(sources, wait, return_embeddings, self.timeout)
        if self._ipc is not None and self._ipc_meta is _UNKNOWN:
            self._ipc_meta = (await self.metadata()).get("ipc")
        ipc, t = _encode_ipc(self._ipc, self._ipc_meta, self._transport), self._transport
        sent = time.monotonic()
        try:
            infos = await t.encode(sources, True, return_embeddings, self.timeout, **ipc)
        except BaseException:
            _restore(ipc, t)
            raise
        for info in infos:
            rows = out(info)
            held = ipc and _copy_held(self._ipc, self._ipc_meta, info, rows, t)
            if not (held and self._by_ipc(await asyncio.to_thread(
                    self._ipc.finish, _whole(info), info.ipc, rows, 0, sent, t.ipc_acks, t.base_url))):
                await self.fetch([(info.id, 0)], 0, info.num_tokens, out=rows)
        return infos

    async def encode_videos(self, videos: Sequence, wait: bool = False, return_embeddings: bool = False,
                            **options) -> list[VideoInfo]:
        """See EncoderClient.encode_videos."""
        return await self._transport.encode_videos([video_source(v, **options) for v in videos], wait,
                                                   return_embeddings, self.timeout)

    async def fetch(self, items, start: int, end: int, out: torch.Tensor | None = None) -> FetchedRows:
        """See EncoderClient.fetch."""
        items = fetch_items(items)
        if self._ipc is not None and out is not None and self._ipc.candidate(out):
            got = await self._fetch_ipc(items, start, end, out)
            if got is not None:
                return got
        self.fetch_paths["shm" if self._shm is not None else "socket"] += 1
        if self._shm is None:
            parts = split_points(start, end, out, self.fetch_streams)
            if len(parts) == 1:
                return await self._fetch_part(items, start, end, out)
            tasks = [asyncio.ensure_future(self._fetch_part(items, lo, hi, _part_out(out, start, lo, hi)))
                     for lo, hi in parts]
            try:
                await asyncio.wait(tasks)
            finally:  # cancelled: so are the streams (each stops its reader thread)
                for t in tasks:
                    t.cancel()
            failed = [t.exception() for t in tasks if t.exception() is not None]  # (all retrieved)
            if failed:
                raise failed[0]
            return joined(start, end, [t.result() for t in tasks], out)
        if self._geometry is None:
            meta = await self.metadata()
            self._geometry = (meta["dtype"], int(meta["row_width"]))
        plan, ok = _ShmFetch(self._shm, self._row_pool, out, start, end, *self._geometry), False
        try:
            header, shm_bytes = await self._transport.fetch_shm(items, start, end, plan.target, self.timeout)
            result = _result(start, end, (header, plan.finish(header, shm_bytes)))
            ok = True
            return result
        finally:
            plan.close(ok)

    async def _fetch_part(self, items, start: int, end: int, out: torch.Tensor | None) -> FetchedRows:
        with Destination(out, start, self._staging_buffers, self._row_pool) as dest:
            return _result(start, end, await self._transport.fetch(items, start, end, dest, self.timeout))

    async def _fetch_ipc(self, items, start: int, end: int, out: torch.Tensor) -> FetchedRows | None:
        """See EncoderClient._fetch_ipc (the copy and its synchronization on a thread, off the loop)."""
        if self._ipc_meta is _UNKNOWN:
            self._ipc_meta = (await self.metadata()).get("ipc")
        if not self._ipc.wants(out, self._ipc_meta):
            return None
        got = await IpcRoute(self._transport, self._routing, items, self.timeout).run_async(start, end)
        copied = await asyncio.to_thread(self._ipc.finish, *_finish_args(got, out, start))
        return self._fetched_by_ipc(start, end, got, copied)

    async def release(self, ids) -> ReleaseCount:
        """See EncoderClient.release."""
        return ReleaseCount(await self._transport.release(_ids(ids), self.timeout))

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
            if self._ipc is not None:
                await asyncio.to_thread(self._ipc.close)  # its last acknowledgements first
            await self._transport.close()
        finally:
            self._staging_buffers.close()
            self._row_pool.close()
            if self._shm is not None:
                self._shm.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
