"""Where a fetch's rows go, chosen before any wait (core/encoder.py: fetch), each with its own steps:

  RowsTo   the rows in the answer (gathered into one tensor when the chunk has several images: bounded by
           --max-fetch-bytes, checked once the chunk is planned)
  ShmTo    into the caller's shared-memory file (protocol/shm.py: ShmTarget): the file is checked once the
           chunk is planned, before the wait for rows; each segment's rows copied straight to its place
  IpcTo    left in the device row arena for a consumer on this host (core/ipc_fetch.py): what can be told
           without rows is answered before any wait: IPC off, the consumer on another host, or an id this
           replica neither holds nor encodes, with its owner's address (replicas/directory.py: Located.url) for
           the consumer to ask. Rows are read from here only (flights, the local tier): pulling them from
           another replica would end a pin there (a delivered fetch) only to find them in no arena here.

Per fetch: `early(keys)` (an answer without rows, or None), `planned(segments, start)` (once the chunk's
segments are known), then `finish(parts, result, delivered)` with the segments' rows (host tensors) and the
answer without them (which it completes), or `abort()` when the rows never came. `delivered()` hands the
fetch's rows to the pins (core/encoder.py: _delivered): at once for rows and shm (not for a peer's "copy"),
at the acknowledgement for IPC.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from encoder_service import errors
from encoder_service.cache import CacheKey
from encoder_service.core import shm_writer
from encoder_service.core.id_rows import IdRows, Reach
from encoder_service.core.ipc_fetch import IpcFetches
from encoder_service.core.types import FetchResult
from encoder_service.protocol.ipc import IpcRequest, IpcUnavailable
from encoder_service.protocol.shm import ShmTarget, placements
from encoder_service.ranges import Segment
from encoder_service.replicas import Replicas


class RowsTo:
    """The rows in the answer."""

    def __init__(self, peer: str | None, row_bytes: int, max_fetch_bytes: int, dtype: torch.dtype):
        self.reach = Reach.HELD if peer is not None else Reach.ANY  # another replica asks: only what is held
        self._peer, self._row_bytes, self._limit, self._dtype = peer, row_bytes, max_fetch_bytes, dtype

    async def early(self, keys: Mapping[str, CacheKey]) -> None:
        return None

    def planned(self, segments: list[Segment], start: int) -> None:
        if len(segments) > 1:  # gathered into one new tensor (finish): bounded
            nbytes = sum(s.num_rows for s in segments) * self._row_bytes
            if nbytes > self._limit:
                raise errors.LimitExceeded("bytes of rows the fetch gathers", nbytes,
                                           f"{self._limit} (--max-fetch-bytes)", hint="fetch the prompt chunk by chunk")

    def abort(self) -> None:
        pass

    async def finish(self, parts: list[torch.Tensor], result: FetchResult,
                     delivered: Callable[[], None]) -> FetchResult:
        if len(parts) == 1:  # one image in the chunk: its rows are already one contiguous view, no copy
            rows = parts[0]
        else:
            rows = torch.cat(parts) if parts else torch.empty((0, result.row_width), dtype=self._dtype)
        if self._peer != "copy":  # a replica that keeps what it pulls ends no pin here
            delivered()
        result.rows = rows.contiguous()
        return result


class ShmTo:
    """Into the caller's shared-memory file: checked before the wait for rows, released if they never come."""

    reach = Reach.ANY

    def __init__(self, writer: shm_writer.ShmWriter, target: ShmTarget, row_bytes: int, peer: str | None):
        self._writer, self._target, self._row_bytes, self._peer = writer, target, row_bytes, peer
        self._places: list[tuple[int, int]] = []
        self._mapping = None

    async def early(self, keys: Mapping[str, CacheKey]) -> None:
        return None

    def planned(self, segments: list[Segment], start: int) -> None:
        self._places = placements(segments, start, self._row_bytes, self._target.by_position)
        self._mapping = self._writer.check(self._target, max((at + n for at, n in self._places), default=0))

    def abort(self) -> None:
        if self._mapping is not None:
            self._writer.release(self._mapping)
            self._mapping = None

    async def finish(self, parts: list[torch.Tensor], result: FetchResult,
                     delivered: Callable[[], None]) -> FetchResult:
        mapping, self._mapping = self._mapping, None
        if any(p.numel() * p.element_size() != n for (_, n), p in zip(self._places, parts)):
            self._writer.release(mapping)  # rows of another width or dtype than checked: never write past them
            raise errors.EncoderServiceError("cached rows do not match this model's row size")
        t0 = time.perf_counter()
        # each segment's rows straight to its place in the file: no concatenation
        result.shm_bytes = await self._writer.write(mapping, self._target.offset,
                                                    [(at, p) for (at, _), p in zip(self._places, parts)])
        result.timings["shm_ms"] = (time.perf_counter() - t0) * 1e3
        if self._peer != "copy":
            delivered()
        return result


class IpcTo:
    """Where the rows sit in the device row arena (core/ipc_fetch.py), or why not; delivered (pins) once the
    consumer acknowledges its copy."""

    reach = Reach.HERE  # rows on this replica's GPU: never pulled from another one

    def __init__(self, fetches: IpcFetches, request: IpcRequest, id_rows: IdRows, replicas: Replicas):
        self._fetches, self._request, self._id_rows, self._replicas = fetches, request, id_rows, replicas

    async def early(self, keys: Mapping[str, CacheKey]) -> IpcUnavailable | None:
        refused = self._fetches.refusal(self._request)
        if refused is not None:
            return refused
        away = next((key for key in keys.values() if not self._id_rows.here(key)), None)
        if away is None:
            return None
        located = await self._replicas.locate(away, strict=False)  # one directory read (kept a second), no wait
        return self._fetches.not_here(away.id, located.url if located is not None else None)

    def planned(self, segments: list[Segment], start: int) -> None:
        pass

    def abort(self) -> None:
        pass

    async def finish(self, parts: list[torch.Tensor], result: FetchResult,
                     delivered: Callable[[], None]) -> FetchResult:
        result.ipc = self._fetches.answer(self._request, parts, delivered)
        return result


FetchDestination = RowsTo | ShmTo | IpcTo


class Destinations:
    """Chooses each fetch's destination (`choose`), from the core's parts: the shm writer (None: shm fetch is
    off), the IPC fetches, where ids' rows are, the other replicas, the rows' dtype and bytes, --max-fetch-bytes."""

    def __init__(self, shm: shm_writer.ShmWriter | None, ipc: IpcFetches, id_rows: IdRows, replicas: Replicas,
                 *, dtype: torch.dtype, row_bytes: int, max_fetch_bytes: int):
        self.shm, self.ipc, self._id_rows, self._replicas = shm, ipc, id_rows, replicas
        self._dtype, self._row_bytes, self._max_fetch_bytes = dtype, row_bytes, max_fetch_bytes

    def choose(self, shm: ShmTarget | None, ipc: IpcRequest | None, peer: str | None) -> FetchDestination:
        if ipc is not None:
            if shm is not None:
                raise errors.InvalidInput("a fetch asks for shm or ipc, not both")
            self.ipc.ack(ipc.ack)  # earlier fetches' copies are done
            return IpcTo(self.ipc, ipc, self._id_rows, self._replicas)
        if shm is not None:
            if self.shm is None:
                raise shm_writer.disabled()
            return ShmTo(self.shm, shm, self._row_bytes, peer)
        return RowsTo(peer, self._row_bytes, self._max_fetch_bytes, self._dtype)
