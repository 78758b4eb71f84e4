"""Fetching, scheduler side: an item's rows from the encoder service into a range of our arenas (arenas.py),
over shared memory (the encoder writes into our file) or a socket (our client writes what it brings); or, by
IPC, a fetch that finds the rows in the encoder's device row arena and holds them there for the workers to
copy GPU to GPU (ipc_loads.py; rows not there are staged as above). That one request is all a load by IPC
costs: the hold rides to the workers in the step's metadata, they copy under it and report its token, and
it is acknowledged from here (`copied`, on the acknowledgement thread of client/ipc.py: Acks) to the
replica that held it: a replica behind the Service that does not hold the item answers "not here" with its
owner's address, which is asked next (one more request, no rows moved between replicas), and later fetches
of the item first, by the clients' rules (client/ipc_route.py, client/owners.py: a bounded set of owners, one
that fails forgotten).

vLLM's encoder cache holds an image's rows, or a video's: all its frame groups' rows, group after group
(Qwen3-VL's timestamp text between groups is not in it). The encoder caches a video per frame group, so a
video is fetched as its groups' items, `<video id>#<g>` at row g * tokens_per_group, in one call."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
from urllib.parse import urlsplit

import torch

from encoder_service import errors
from encoder_service.client import EncoderClient
from encoder_service.client.grpc_transport import GrpcTransport
from encoder_service.client.http import HttpTransport
from encoder_service.client.ipc import Acks
from encoder_service.client.ipc_route import IpcRoute
from encoder_service.client.owners import OwnerRouting
from encoder_service.client.shm import ShmBuffers
from encoder_service.integrations.vllm.arenas import RowArenas, StagedRows
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.worker import IpcHold, IpcRows, ShmRows
from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.ipc import IpcPlacement, this_host
from encoder_service.protocol.video_info import GROUP_SEP

log = logging.getLogger("encoder_service.integrations.vllm")

MAX_HOLDS = 4096  # holds remembered until acknowledged (the server's own bound on live holds)


class ItemUnavailable(Exception):
    """An item's rows can't be had (unknown or evicted id, encoder down, wrong width or row count)."""


class RowFetcher:
    """Fetches items' rows from the encoder service into our arenas (scheduler side; also the benchmark's).

    Thread-safe: `fetch` blocks (call it from worker threads). `mode` is "shm" (the encoder writes into our
    file), "http" or "grpc" (our client writes what the socket brings), or "ipc" (rows left on the encoder's
    GPU for the workers, items not there staged the shm / socket way). With shm "auto", an encoder that
    can't reach our files (another container's /dev/shm) turns the fetcher to the socket once, logged.
    `ipc_kind`: the IPC memory vLLM's workers can open (rowpath/cuda_ipc.py: KIND on CUDA workers; None:
    no IPC); with ipc "auto", IPC is used when the encoder's arena is of that kind, on this host, over HTTP.
    """

    def __init__(self, options: ConnectorOptions, expected_width: int | None = None, ipc_kind: str | None = None):
        self.options, self.expected_width, self.ipc_kind = options, expected_width, ipc_kind
        self._buffers = ShmBuffers(options.shm_dir)
        self.arenas = RowArenas(self._buffers, options.arena_bytes, options.fetch_timeout_s)
        self._lock = threading.Lock()
        self._clients: dict[bool, object] = {}  # shm? -> EncoderClient
        self._meta: dict | None = None
        self._shm: bool | None = None if options.shm == "auto" else options.shm == "on"
        self._ipc: bool | None = None if options.ipc == "auto" and ipc_kind else False
        self._ipc_fetches: OwnerRouting | None = None  # the IPC fetches': the Service's, and the owners it named
        self._held: dict[str, Acks] = {}  # hold token -> the acks of the replica that holds it (oldest first)
        self._unused: set[str] = set()  # tokens of the holds taken, not yet given to a load
        self._said_unplaced = False

    @property
    def mode(self) -> str:
        return "ipc" if self._ipc else self.staging_mode

    @property
    def staging_mode(self) -> str:
        """How rows not on the encoder's GPU come (the only way without IPC)."""
        return "shm" if self._shm else self.options.transport

    def _client(self, shm: bool):
        with self._lock:
            if shm not in self._clients:
                o = self.options
                if o.transport == "grpc":
                    transport = GrpcTransport(urlsplit(o.url).netloc, token=o.auth_token)
                else:
                    transport = HttpTransport(o.url, token=o.auth_token)
                self._clients[shm] = EncoderClient(transport, timeout=o.fetch_timeout_s,
                                                   shm=self._buffers if shm else None)
            return self._clients[shm]

    def metadata(self) -> dict:
        """The encoder's /v1/metadata, checked once against the model: row width, a row dtype we know."""
        if self._meta is not None:
            return self._meta
        try:
            meta = self._client(False).metadata()
        except errors.EncoderServiceError as exc:
            raise ItemUnavailable(f"encoder service at {self.options.url} unreachable: {exc}") from None
        width, family = int(meta["row_width"]), meta.get("family")
        if self.expected_width is not None and width != self.expected_width:
            raise ItemUnavailable(
                f"encoder service at {self.options.url} serves {family} ({meta.get('model')}) rows {width} wide "
                f"(layout {meta.get('layout')}); this model takes rows {self.expected_width} wide: serve the "
                "same checkpoint family on both sides")
        torch_dtype(meta["dtype"])
        if self._shm is None:
            self._shm = bool(meta.get("shm_fetch")) and _is_this_host(urlsplit(self.options.url).hostname or "")
        if self._ipc is None:
            ipc = meta.get("ipc") or {}
            self._ipc = (self.options.transport == "http" and ipc.get("kind") == self.ipc_kind
                         and ipc.get("host") == this_host() != "")
        log.info("encoder service %s (%s, rows %d wide, %s): fetching over %s", self.options.url, family, width,
                 meta["dtype"], "ipc, else " + self.staging_mode if self._ipc else self.mode)
        self._meta = meta
        return meta

    def fetch(self, item_id: str, num_rows: int, groups: int | None = None) -> StagedRows:
        """Item `item_id`'s rows, exactly `num_rows` of them, staged in an arena, or by IPC left on the encoder's
        GPU (`ref` an IpcRows); ItemUnavailable else. `groups`: a video's frame groups, each num_rows / groups
        rows (None: an image)."""
        meta = self.metadata()
        width, dtype = int(meta["row_width"]), meta["dtype"]
        items, per_item = fetch_items(item_id, num_rows, groups)
        # One row more than planned: an item with more rows than vLLM planned shows as num_rows + 1.
        span = num_rows + 1
        arena = start = None
        ok = False
        try:
            if self._ipc:
                held = self._hold(item_id, items, per_item, span)
                if held is not None:
                    got, hold = held
                    try:
                        _check_count(item_id, got, num_rows, groups)
                    except ItemUnavailable:
                        self._ack(hold.placement.token)
                        raise
                    with self._lock:
                        self._unused.add(hold.placement.token)
                    ok = True
                    return StagedRows(item_id, None, IpcRows(item_id, groups, num_rows, width, dtype, hold), None,
                                      0, 0)
            arena, start = self.arenas.take(span, width, dtype)
            got = self._fetch_into(item_id, items, per_item, arena.rows[start:start + span])
            _check_count(item_id, got, num_rows, groups)
            ok = True
        except ItemUnavailable:
            raise
        except errors.NotFound as exc:
            raise ItemUnavailable(f"item {item_id!r} is not at the encoder service ({exc}): unknown, or evicted "
                                  "after its lease; the request's image or video uuid must be the id our encode "
                                  "answered, and vLLM keeps a uuid only when the request has no mm_processor_kwargs "
                                  "and the server no --media-io-kwargs for its modality") from None
        except errors.EncoderServiceError as exc:
            raise ItemUnavailable(f"fetch of item {item_id!r} from {self.options.url} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the wire, a file: the request fails, the engine goes on
            raise ItemUnavailable(f"fetch of item {item_id!r} failed: {type(exc).__name__}: {exc}") from None
        finally:
            if not ok and arena is not None:  # the encoder may still write a timed-out fetch: the range rests
                self.arenas.give(arena, start, span, quarantine=True)
        offset = start * arena.rows.stride(0) * arena.rows.element_size()
        ref = ShmRows(arena.name, self.options.shm_dir, offset, num_rows, width, dtype)
        return StagedRows(item_id, arena.rows[start:start + num_rows], ref, arena, start, span)

    def load_ref(self, staged: StagedRows) -> ShmRows | IpcRows:
        """What the workers get for a load of `staged`: rows left on the encoder's GPU come with the hold this
        fetcher took on them the first time (the workers copy under it, no request of theirs), without it
        after (vLLM evicted the item and loads it again: each worker fetches it with a hold of its own)."""
        ref = staged.ref
        if isinstance(ref, IpcRows) and ref.hold is not None:
            with self._lock:
                fresh = ref.hold.placement.token in self._unused
                self._unused.discard(ref.hold.placement.token)
            if not fresh:
                return dataclasses.replace(ref, hold=None)
        return ref

    def copied(self, tokens) -> None:
        """Every worker copied the rows of these holds (vLLM's worker -> scheduler metadata, gathered from all
        ranks): acknowledge them (client/ipc.py: Acks, a background thread)."""
        for token in tokens:
            self._ack(token)

    def drop(self, staged: StagedRows) -> None:
        """The item's range back to its arena (no worker may read it any more); rows left on the encoder's GPU
        have none, but a hold no load took is acknowledged (nobody will read under it)."""
        if staged.arena is not None:
            self.arenas.give(staged.arena, staged.start, staged.span)
        elif isinstance(staged.ref, IpcRows) and staged.ref.hold is not None:
            token = staged.ref.hold.placement.token
            with self._lock:
                unused = token in self._unused
                self._unused.discard(token)
            if unused:
                self._ack(token)

    def ipc_refused(self, why: str) -> None:
        """A worker may not open the encoder's IPC handle (vLLM's worker -> scheduler metadata): stage every
        later item in host memory."""
        if self._ipc:
            log.warning("a vLLM worker can't open the encoder's IPC memory (%s): staging rows over %s from now on",
                        why, self.staging_mode)
            self._ipc = False

    def _hold(self, item_id: str, items: list[tuple[str, int]], per_item: int,
              span: int) -> tuple[int, IpcHold] | None:
        """(how many rows the item has, checked as `_fetch_into` checks them; the hold on them) when all of them
        are in the encoder's device row arena; None when they are not (logged once): stage them instead."""
        routing = self._ipc_routing()
        got = IpcRoute(routing.service, routing, items, self.options.fetch_timeout_s).run(0, span)
        header, answer = got.header, got.answer
        if not isinstance(answer, IpcPlacement):  # (an answer given before any wait has no segments)
            if not self._said_unplaced:
                log.info("item %s is not on the encoder's GPU (%s): staging it over %s (logged once)", item_id,
                         answer.reason, self.staging_mode)
                self._said_unplaced = True
            return None
        self._remember(answer.token, got.transport.ipc_acks)
        try:
            rows = checked_rows(item_id, items, per_item, header.segments)
        except ItemUnavailable:
            self._ack(answer.token)
            raise
        segments = header.segments
        return rows, IpcHold(answer, tuple(s.position for s in segments), tuple(s.num_rows for s in segments),
                             got.sent + answer.lease_s, got.server)

    def _ipc_routing(self) -> OwnerRouting:
        with self._lock:
            if self._ipc_fetches is None:
                self._ipc_fetches = OwnerRouting(self._http(self.options.url), self._http, self.options.url)
            return self._ipc_fetches

    def _http(self, url: str) -> HttpTransport:
        return HttpTransport(url, token=self.options.auth_token, ipc_channel=self.options.ipc_channel == "auto")

    def _remember(self, token: str, acks: Acks) -> None:
        with self._lock:
            self._held[token] = acks
            if len(self._held) > MAX_HOLDS:  # a hold never reported (a worker gone): its lease ends it
                self._held.pop(next(iter(self._held)))

    def _ack(self, token: str) -> None:
        """The hold's copies are done (or will never be made): acknowledged to the replica that holds it (one
        no longer remembered, past MAX_HOLDS: not acknowledged, its lease ends it)."""
        with self._lock:
            acks = self._held.pop(token, None)
        if acks is not None:
            acks.add(token)

    def _fetch_into(self, item_id: str, items: list[tuple[str, int]], per_item: int, out: torch.Tensor) -> int:
        """Rows [0, len(out)) of `items` into `out`; how many rows the item has there (checked: one segment per
        fetch item, at its offset from its row 0, each but the last `per_item` rows)."""
        shm = bool(self._shm)
        try:
            result = self._client(shm).fetch(items, 0, out.shape[0], out=out)
        except (errors.InvalidInput, errors.FailedPrecondition) as exc:
            if not (shm and self.options.shm == "auto" and "shm" in str(exc)):
                raise
            log.warning("encoder service %s can't write into our shared memory (%s); fetching over the socket "
                        "from now on", self.options.url, exc)
            self._shm = False
            result = self._client(False).fetch(items, 0, out.shape[0], out=out)
        return checked_rows(item_id, items, per_item, result.segments)

    def release(self, ids: list[str]) -> None:
        try:
            self._client(False).release(ids)
        except Exception as exc:  # noqa: BLE001 - pins end at their lease anyway
            log.debug("release of %d ids at %s failed: %s", len(ids), self.options.url, exc)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        if self._ipc_fetches is not None:
            self._ipc_fetches.close()  # the pending acknowledgements first
        self.arenas.close()
        self._buffers.close()  # unlinks every file (tensors still viewing them keep their mappings)


def fetch_items(item_id: str, num_rows: int, groups: int | None) -> tuple[list[tuple[str, int]], int]:
    """(the fetch items of a vLLM item's rows [0, num_rows), rows per item): an image is its id at row 0; a
    video of `groups` frame groups is its groups' ids one after the other."""
    if groups is None:
        return [(item_id, 0)], num_rows
    if groups <= 0 or num_rows % groups:
        raise ItemUnavailable(f"video {item_id!r}: vLLM planned {num_rows} rows in {groups} frame groups")
    per_group = num_rows // groups
    return [(f"{item_id}{GROUP_SEP}{g}", g * per_group) for g in range(groups)], per_group


def checked_rows(item_id: str, items: list[tuple[str, int]], per_item: int, segments) -> int:
    """How many rows a fetch of `items` (fetch_items) found, checked: one segment per fetch item, at its offset
    from its row 0, each but the last `per_item` rows; ItemUnavailable else."""
    segments = list(segments)
    if [(s.id, s.position, s.row_start) for s in segments] != [(i, at, 0) for i, at in items]:
        raise ItemUnavailable(f"fetch of item {item_id!r}: unexpected segments {segments}")
    for s in segments[:-1]:
        if s.num_rows != per_item:
            raise ItemUnavailable(
                f"frame group {s.id!r} has {s.num_rows} rows at the encoder service, vLLM planned {per_item} "
                "a group: the video_grid_thw sent to vLLM must be the one our encode answered")
    return sum(s.num_rows for s in segments)


def _check_count(item_id: str, got: int, num_rows: int, groups: int | None) -> None:
    if got != num_rows:
        more = "more than " if got > num_rows else ""
        raise ItemUnavailable(
            f"item {item_id!r} has {more}{min(got, num_rows)} rows at the encoder service, vLLM planned "
            f"{num_rows} placeholder tokens for it: the {_grid_key(groups)} sent to vLLM must be the one "
            "our encode answered, and both sides must use the same merge size")


def _grid_key(groups: int | None) -> str:
    return "image_grid_thw" if groups is None else "video_grid_thw"


def _is_this_host(host: str) -> bool:
    """`host` is loopback or one of this machine's names / addresses (so its /dev/shm may be ours)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        if host == "localhost":
            return True
    try:
        ours = {socket.gethostname(), socket.getfqdn()}
        addresses = {a[4][0] for name in ours for a in socket.getaddrinfo(name, None)}
        return host in ours or any(a[4][0] in addresses for a in socket.getaddrinfo(host, None))
    except OSError:
        return False
