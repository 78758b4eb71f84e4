"""Rows from another replica: a fetch of a range of one id's rows from the replica that holds them, over the
same HTTP row path clients use (POST /v1/fetch; the owner's send threads write the rows on the socket, and
`rowpath/raw_http.py` reads them with recv_into straight into place).

Behind one Service a fetch may reach a replica that does not hold the id (the directory in Redis names the
one that does: replicas/directory.py). That replica asks the owner for just the chunk's rows, into host memory
of its own (the engine's HostRowPool: pages of rows freed before, not fresh ones), and passes them on. A
range over `split_bytes` is fetched over several connections at once (each its own slice of the
destination), as the client does for a large `out`.

    peers = Peers(token=..., row_width=..., dtype=torch.bfloat16, pool=engine.host_pool)
    rows, located = await peers.from_owner(directory, key, 0, 713, copy=False)

The request says it comes from a peer (`"peer": "fetch"`, or `"copy"` for a replica that keeps what it
pulls, whose fetch must not end the owner's pins): the owner answers at once from the rows it holds, never
waits for an encode and never asks a third replica (core/id_rows.py), so a directory that is out of date
can never send a fetch round in a circle, nor to this replica's own flight. Only addresses other replicas
wrote into the directory are asked (http:// only; never one that is this replica's own: redis_reads.py).

What a replica trusts of the directory, which whoever can write Redis can write (issue 38):
  - The request carries no token: it is signed with a key derived from it (protocol/peer_auth.py), for the
    replica the directory names, so a forged address learns nothing it can use elsewhere. A 401 means the
    replicas do not share one token: PeerAuthMismatch, a configuration error (503 naming it, logged), not
    "wrong bearer token".
  - The rows are checked against the block checksums the owner wrote into the directory with its location
    (`Located.block_sums`, whose digest its header carries): a range is fetched whole blocks at a time (up
    to two partial blocks more, < 2 x 64 KiB) and each block checked. Rows that do not match are refused
    (counted, logged): a failure like an owner gone.

A silent owner (frozen, hung, its packets dropped) must not hold a fetch: the connect has CONNECT_S, the
answer's head and each read of its rows ANSWER_S (a live owner answers what it holds at once), whatever
the caller's timeout. One that does not answer in time is not asked again for SILENT_S (its fetches fail
over at once: shared.py takes the image over, through the core). Each owner has its own SLOTS threads (a bulkhead):
a slow one holds only its own fetches, never another owner's.

Failures are the service's error types: Unavailable (the owner is gone, unreachable, silent, or its rows are
not the directory's), NotFound (it no longer holds the id), PeerAuthMismatch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from urllib.parse import urlsplit

import torch

from encoder_service import errors
from encoder_service.cache import CacheKey
from encoder_service.cache.entry import CorruptEntry, verify_rows
from encoder_service.rowpath.raw_http import ConnectTimedOut, NoAnswer, NotRaw, RawHttp, in_thread, read_fetch
from encoder_service.protocol import peer_auth, wire
from encoder_service.protocol.dtypes import DTYPES
from encoder_service.replicas.directory import Located
from encoder_service.replicas.redis_reads import DirectoryReads
from encoder_service.timeouts import gather_within

log = logging.getLogger(__name__)

MAX_PEERS = 64  # replicas with kept-alive sockets and threads (one per live replica)
SLOTS = 8  # fetches receiving from one replica at once (each blocks in recv_into, the GIL released)
SPLIT_BYTES = 8 << 20  # a range over this goes over several connections at once
STREAMS = 4
CONNECT_S = 0.5  # a live replica's kernel answers a connect at once (loopback, a LAN hop)
ANSWER_S = 1.0  # the answer's head, then each read of its rows: the owner answers what it holds at once
SILENT_S = 5.0  # a replica that did not answer in time (or sent rows not the directory's) is not asked again
LOG_EVERY_S = 60.0  # one line per replica about a signature it refused, at most this often
FETCH_PATH = "/v1/fetch"


class PeerAuthMismatch(errors.Unavailable):
    """The owner refused this replica's signature: the replicas do not share one --auth-token (or their
    clocks are more than protocol/peer_auth.py's WINDOW_S apart)."""


class _NoAnswer(errors.Unavailable):
    pass


class _Foreign(errors.Unavailable):
    pass


class _Peer:
    """One replica rows are fetched from: its keep-alive sockets, its own threads, when it is asked again."""

    def __init__(self, url: str, host: str, port: int, slots: int):
        self.url = url
        self.http = RawHttp(host, port, "", {})
        self.threads = ThreadPoolExecutor(slots, thread_name_prefix="encoder-peer")
        self.asked_again_at = 0.0  # time.monotonic(): until then it is not asked (it did not answer)
        self.refusal_logged_at = -LOG_EVERY_S

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.http.close()


class Peers:
    """`token`: the service's bearer token (None: auth off, requests unsigned); `pool`: where pulled rows live
    (a HostRowPool's `take(nbytes)`; None: torch.empty)."""

    def __init__(self, *, token: str | None, row_width: int, dtype: torch.dtype, pool=None, slots: int = SLOTS,
                 split_bytes: int = SPLIT_BYTES, streams: int = STREAMS):
        self._key = peer_auth.peer_key(token) if token else None
        self.row_width, self.dtype, self._pool = row_width, dtype, pool
        self._slots, self._split_bytes, self._streams = slots, split_bytes, streams
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = dict(fetches=0, bytes=0, failures=0, no_answer=0, skipped=0, foreign=0, refused=0)

    async def from_owner(self, directory: DirectoryReads, key: CacheKey, start: int, end: int, *, copy: bool,
                         strict: bool = True) -> tuple[torch.Tensor, Located] | tuple[None, Located | None]:
        """Rows [start, end) of `key` from the replica the `directory` names, and where they were found.
        A replica that does not give them (gone, silent, lost them, rows not the directory's) is forgotten
        and the directory read afresh once (another replica may hold them now: one that encoded them again).
        (None, the last location read) when no live replica gives them. `strict`: Unavailable while Redis is
        down, else (None, None). PeerAuthMismatch: the owner refused this replica's signature."""
        located = None
        for _ in range(2):
            located = await directory.locate(key.name, strict=strict)
            if located is None or located.url is None:
                break
            try:
                return await self.rows(located, key.id, start, end, copy=copy), located
            except PeerAuthMismatch:
                raise
            except (errors.Unavailable, errors.NotFound) as exc:
                log.info("id %s: the replica holding its rows (%s) did not give them: %s", key.id, located.url, exc)
                directory.forget_location(key.name, located.owner)
        return None, located

    async def rows(self, located: Located, public_id: str, start: int, end: int, *, copy: bool) -> torch.Tensor:
        """Rows [start, end) of `public_id` from the replica at `located.url`: a [end - start, row_width] tensor,
        checked against `located.block_sums` when the directory has them."""
        peer = self._peer(located.url)
        if time.monotonic() < peer.asked_again_at:
            self.counters["skipped"] += 1
            raise errors.Unavailable(f"the replica at {peer.url} did not answer in time (or sent rows that are not "
                                     f"the directory's) moments ago: not asked for {SILENT_S:g} s")
        header, block_sums = located.header, located.block_sums
        if block_sums:  # whole blocks, each checked: [lo, hi) covers [start, end)
            first, last = header.block_span(start, end)
            lo, hi = first * header.block_rows, min(last * header.block_rows, header.num_rows)
        else:  # a location written by a replica before the checksums were: nothing to check against
            first, lo, hi = 0, start, end
        out = self._empty(hi - lo)
        row_bytes = self.row_width * self.dtype.itemsize
        # Parts on block boundaries (each checked on its own thread): at most `streams`, each >= split_bytes.
        step = header.block_rows if block_sums else 1
        units = -(-(hi - lo) // step)
        parts = min(self._streams, max(1, (hi - lo) * row_bytes // self._split_bytes), units)
        bounds = [min(hi, lo + step * (units * k // parts)) for k in range(parts + 1)]
        fetch = partial(self._fetch, peer, located, public_id, copy=copy)
        try:  # the first failure cancels the other parts (their sockets shut down: raw_http.in_thread)
            await gather_within(None, *(
                in_thread(peer.threads, partial(fetch, a, b, out[a - lo:b - lo], first + (a - lo) // step))
                for a, b in zip(bounds, bounds[1:])))
        except errors.EncoderServiceError as exc:  # (a cancellation, the caller gone, is no failure)
            self.counters["failures"] += 1
            self._failed(peer, exc)
            raise
        self.counters["fetches"] += 1
        self.counters["bytes"] += (end - start) * row_bytes
        return out[start - lo:end - lo]

    def _failed(self, peer: _Peer, exc: BaseException) -> None:
        if isinstance(exc, (_NoAnswer, _Foreign)):
            self.counters["no_answer" if isinstance(exc, _NoAnswer) else "foreign"] += 1
            peer.asked_again_at = time.monotonic() + SILENT_S
            if isinstance(exc, _Foreign):
                log.warning("%s: refused (counted in encoder_peer_failures_total{reason=\"foreign_rows\"})", exc)
        elif isinstance(exc, PeerAuthMismatch):
            self.counters["refused"] += 1
            now = time.monotonic()
            if now - peer.refusal_logged_at >= LOG_EVERY_S:
                peer.refusal_logged_at = now
                log.error("%s (a configuration error: fetches of its ids answer 503 here until it is fixed)", exc)

    def _fetch(self, peer: _Peer, located: Located, public_id: str, start: int, end: int, out: torch.Tensor,
               first_block: int, cancel, *, copy: bool) -> None:
        """Rows [start, end) into `out`, on one of the peer's threads; checked from `first_block` on."""
        # timeout_s 0: the owner answers what it holds now (an id it is still encoding: 404 at once, never a wait)
        body = json.dumps({"items": [{"id": public_id, "offset": 0}], "start": start, "end": end, "timeout_s": 0,
                           "peer": "copy" if copy else "fetch"}).encode()
        headers = {"authorization": peer_auth.sign(self._key, "POST", FETCH_PATH, body, located.owner)} \
            if self._key is not None else None

        def writer(header: wire.WireHeader) -> wire.RowWriter:
            if DTYPES.get(header.dtype) != self.dtype or header.row_width != self.row_width \
                    or header.num_rows != end - start:
                raise errors.Unavailable(f"the replica at {peer.url} answered {header.num_rows} rows of "
                                         f"{header.row_width} {header.dtype}: not this model's rows (another model "
                                         "behind the same Redis?)")
            return wire.RowWriter(header, out, start)

        try:
            peer.http.post(FETCH_PATH, body, ANSWER_S, read_fetch(writer), cancel=cancel, headers=headers,
                           connect_s=CONNECT_S)
        except (NoAnswer, ConnectTimedOut) as exc:
            raise _NoAnswer(f"the replica at {peer.url} did not answer in time ({exc.message}): frozen, hung or "
                            f"unreachable; not asked for {SILENT_S:g} s") from None
        except errors.Unauthenticated as exc:
            raise PeerAuthMismatch(f"peer auth mismatch: the replica at {peer.url} refused this replica's signed "
                                   f"request ({exc.message}): every replica must have the same --auth-token") from None
        except NotRaw as exc:
            raise errors.Unavailable(f"the replica at {peer.url} answered what a replica does not: {exc}") from None
        except wire.WireError as exc:
            raise errors.Unavailable(f"the replica at {peer.url}'s answer was cut short: {exc}") from None
        except (errors.NotFound, errors.Unavailable):
            raise
        except errors.EncoderServiceError as exc:  # its answer, never the caller's fault (a 400 here would be)
            raise errors.Unavailable(f"the replica at {peer.url} answered {exc.kind}: {exc.message}") from None
        if located.block_sums:
            try:
                verify_rows(located.header, located.block_sums, first_block, out)
            except CorruptEntry as exc:
                raise _Foreign(f"rows of {public_id!r} from the replica at {peer.url} do not match the checksums "
                               f"the directory holds for them ({exc.message})") from None

    def _empty(self, num_rows: int) -> torch.Tensor:
        nbytes = num_rows * self.row_width * self.dtype.itemsize
        flat = self._pool.take(nbytes) if self._pool is not None else torch.empty(nbytes, dtype=torch.uint8)
        return flat.view(self.dtype).view(num_rows, self.row_width)

    def _peer(self, url: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(url)
            if peer is not None:
                self._peers.move_to_end(url)
                return peer
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise errors.Unavailable(f"the directory names a replica at {url!r:.100}, not an http://host:port "
                                     "address: not asked")
        with self._lock:
            peer = self._peers.get(url)
            if peer is None:
                peer = self._peers[url] = _Peer(url, parts.hostname, parts.port or 80, self._slots)
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)[1].close()
        return peer

    def stats(self) -> dict:
        return dict(self.counters)

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
