"""Rows from another replica: a fetch of a range of one id's rows from the replica that holds them, over the
same HTTP row path clients use (POST /v1/fetch; the owner's send threads write the rows on the socket, and
`client/raw_http.py` reads them with recv_into straight into place).

Behind one Service a fetch may reach a replica that does not hold the id (the directory in Redis names the
one that does: cache/directory.py). That replica asks the owner for just the chunk's rows, into host memory
of its own (the engine's HostRowPool: pages of rows freed before, not fresh ones), and passes them on. A
range over `split_bytes` is fetched over several connections at once (each its own slice of the
destination), as the client does for a large `out`.

    peers = Peers(token=..., row_width=..., dtype=torch.bfloat16, pool=engine.host_pool)
    rows = await peers.rows("http://10.0.0.7:8000", "u:photo-1", 0, 713, timeout_s=30.0, copy=False)

The request says it comes from a peer (`"peer": "fetch"`, or `"copy"` for a replica that keeps what it
pulls, whose fetch must not end the owner's pins): the owner answers from what it holds only, never asks a
third replica, so a directory that is out of date can never send a fetch round in a circle. Only addresses
other replicas wrote into the directory are asked (http:// only), with the service's own bearer token.
Failures are the service's error types: Unavailable (the owner is gone or unreachable), NotFound (it no
longer holds the id), DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import torch

from encoder_service import errors
from encoder_service.cache import CacheKey, EmbeddingStore, Located
from encoder_service.client.raw_http import NotRaw, RawHttp, read_fetch
from encoder_service.protocol import wire
from encoder_service.protocol.dtypes import DTYPES

log = logging.getLogger(__name__)

MAX_PEERS = 64  # origins with kept-alive sockets (one per live replica)
THREADS = 16  # peer fetches receiving at once (each blocks in recv_into, the GIL released)
SPLIT_BYTES = 8 << 20  # a range over this goes over several connections at once
STREAMS = 4


class Peers:
    """`pool`: where pulled rows live (a HostRowPool's `take(nbytes)`; None: torch.empty)."""

    def __init__(self, *, token: str | None, row_width: int, dtype: torch.dtype, pool=None,
                 threads: int = THREADS, split_bytes: int = SPLIT_BYTES, streams: int = STREAMS):
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self.row_width, self.dtype, self._pool = row_width, dtype, pool
        self._split_bytes, self._streams = split_bytes, streams
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="encoder-peer")
        self._origins: OrderedDict[str, RawHttp] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = dict(fetches=0, bytes=0, failures=0)

    async def rows(self, url: str, public_id: str, start: int, end: int, timeout_s: float | None, *,
                   copy: bool) -> torch.Tensor:
        """Rows [start, end) of `public_id` from the replica at `url`: a new [end - start, row_width] tensor."""
        origin = self._origin(url)
        n = end - start
        out = self._empty(n)
        row_bytes = self.row_width * self.dtype.itemsize
        parts = min(self._streams, max(1, n * row_bytes // self._split_bytes), n)
        bounds = [start + n * k // parts for k in range(parts + 1)]
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(
                self._threads, self._fetch, origin, public_id, lo, hi, out[lo - start:hi - start], timeout_s, copy)
                for lo, hi in zip(bounds, bounds[1:])))
        except BaseException:
            self.counters["failures"] += 1
            raise
        self.counters["fetches"] += 1
        self.counters["bytes"] += n * row_bytes
        return out

    def _fetch(self, origin: RawHttp, public_id: str, start: int, end: int, out: torch.Tensor,
               timeout_s: float | None, copy: bool) -> None:
        body = json.dumps({"items": [{"id": public_id, "offset": 0}], "start": start, "end": end,
                           "timeout_s": timeout_s, "peer": "copy" if copy else "fetch"}).encode()

        def writer(header: wire.WireHeader) -> wire.RowWriter:
            if DTYPES.get(header.dtype) != self.dtype or header.row_width != self.row_width \
                    or header.num_rows != end - start:
                raise errors.Unavailable(f"a peer answered {header.num_rows} rows of {header.row_width} "
                                         f"{header.dtype}: not this model's rows (another model behind the "
                                         "same Redis?)")
            return wire.RowWriter(header, out, start)

        try:
            origin.post("/v1/fetch", body, timeout_s, read_fetch(writer))
        except NotRaw as exc:
            raise errors.Unavailable(f"a peer answered what a replica does not: {exc}") from None
        except wire.WireError as exc:
            raise errors.Unavailable(f"a peer's answer was cut short: {exc}") from None

    def _empty(self, num_rows: int) -> torch.Tensor:
        nbytes = num_rows * self.row_width * self.dtype.itemsize
        flat = self._pool.take(nbytes) if self._pool is not None else torch.empty(nbytes, dtype=torch.uint8)
        return flat.view(self.dtype).view(num_rows, self.row_width)

    def _origin(self, url: str) -> RawHttp:
        with self._lock:
            origin = self._origins.get(url)
            if origin is not None:
                self._origins.move_to_end(url)
                return origin
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise errors.Unavailable(f"the directory names a replica at {url!r:.100}, not an http://host:port "
                                     "address: not asked")
        origin = RawHttp(parts.hostname, parts.port or 80, "", self._headers)
        with self._lock:
            self._origins[url] = origin
            while len(self._origins) > MAX_PEERS:
                self._origins.popitem(last=False)[1].close()
        return origin

    async def from_owner(self, store: EmbeddingStore, key: CacheKey, start: int, end: int,
                         timeout_s: float | None, *, copy: bool, strict: bool = True
                         ) -> tuple[torch.Tensor, Located] | tuple[None, Located | None]:
        """Rows [start, end) of `key` from the replica Redis's directory names, and where they were found.
        A replica that does not give them (gone, or it lost them) is forgotten and the directory read afresh
        once (another replica may hold them now: one that encoded them again). (None, the last location
        read) when no live replica gives them. `strict`: Unavailable while Redis is down, else (None, None)."""
        located = None
        for _ in range(2):
            located = await store.locate(key, strict=strict)
            if located is None or located.url is None:
                break
            try:
                return await self.rows(located.url, key.id, start, end, timeout_s, copy=copy), located
            except (errors.Unavailable, errors.NotFound) as exc:
                log.info("id %s: the replica holding its rows (%s) did not give them: %s", key.id, located.url, exc)
                store.forget_location(key, located.owner)
        return None, located

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for origin in self._origins.values():
                origin.close()
            self._origins.clear()
