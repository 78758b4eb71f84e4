"""The connector's transfer machinery, free of vLLM: fetch an item's rows ahead of need into host shared
memory (scheduler side), and copy them onto the worker's device (worker side). connector.py adapts vLLM's
hooks to it; benchmarks/connector_bench.py drives it directly (no vLLM there).

Where the rows go, and why
--------------------------
vLLM runs the scheduler-side connector in the EngineCore process and one worker-side connector per worker
(TP rank), usually in other processes; the scheduler side can hand a worker only what it puts into the
step's metadata (pickled by vLLM). We follow vLLM's own ECCPUConnector (a shared region the scheduler owns
and the workers map): the scheduler side fetches rows into host shared memory ahead of need and keeps the
books; each worker maps the same memory and copies to its device.

  scheduler side (EngineCore)                                  worker side (each TP rank)
  ensure_cache_available: item not staged -> its fetch         start_load_caches: rows of each load
    starts on a thread; the request is deferred                  (arena file, offset, rows x width)
  fetch: rows [0, n + 1) of the item into a range of an          checked against vLLM's plan, copied to
    arena (a large file of ours in /dev/shm):                    the device -> encoder_cache[identifier]
    - shm: the encoder (same host, --shm-fetch) writes the       (model dtype)
      rows there itself: no socket;
    - socket (HTTP or gRPC): our client writes what the
      socket brings there.
  has_cache_item: staged? (a dict lookup)
  update_state_after_alloc: queue the item's load -> the step's metadata

So no hook waits on the network: the scheduler answers from a dict, a worker only copies rows already in host
memory, and every TP rank reads the same host copy. The arena is the carrier in both modes (only who writes
it changes), so the worker's side is one path. Arenas are reused item after item, so the encoder keeps them
mapped (its pages are faulted in once) and so does each worker (registered with CUDA: the copy is a DMA).

Checks (a bad item fails its request, through `take_failed` -> vLLM's take_unavailable_requests; vLLM is
never handed a wrong tensor): the encoder's row width against the model's (`expected_row_width`: Qwen3-VL
rows are `out_hidden * (1 + deepstack levels)`), once per encoder; the item's row count against what vLLM
planned for its placeholder (the fetch asks for one row more than planned, so an item with more rows is
caught too); a row dtype we know. The worker checks the staged shape against the plan again before copying.

Memory: an item's range is held while vLLM holds the item in its encoder cache (until the scheduler output's
`free_encoder_mm_hashes` names it: bounded by vLLM's own encoder cache size) or while a request that needs it
waits to be scheduled; fetches ahead of need start only while the bytes staged and not yet taken by vLLM stay
under `max_staged_bytes` (one fetch always may). Arenas that empty are unlinked (one is kept), all at close.
"""

from __future__ import annotations

import ipaddress
import logging
import mmap
import os
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Mapping
from urllib.parse import urlsplit

import torch

from encoder_service import errors
from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.shm import DEFAULT_DIR, NAME_RE
from encoder_service.settings import parse_bool, parse_size

log = logging.getLogger("encoder_service.integrations.vllm")

SHM_MODES = ("auto", "on", "off")


class ItemUnavailable(Exception):
    """An item's rows can't be had (unknown or evicted id, encoder down, wrong width or row count)."""


# ---- options ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorOptions:
    """`ec_connector_extra_config` of the vLLM connector (and the benchmark's knobs). Only `url` is required.

    url: `http://host:port` (HTTP) or `grpc://host:port` (gRPC) of the encoder service.
    auth_token: the encoder's --auth-token, if it has one.
    shm: "auto" (shared memory when the encoder runs --shm-fetch and `url` names this host), "on", "off".
    shm_dir: the encoder's --shm-dir (both sides must see the same directory); also where the staged rows
        live in socket mode.
    max_staged_bytes: bound on rows fetched ahead of need and not yet taken by vLLM (sizes: "1GiB", ...).
    arena_bytes: size of one staging file (rows of many items; an item larger than this gets its own).
    fetch_threads: fetches in flight at once.
    fetch_timeout_s: one fetch (it waits for the encoder's ViT when the image is still being encoded).
    wait_timeout_s: how long a request may wait for its items before it is failed.
    release_on_finish: end the encoder's pins (`release`) of a request's items when vLLM finishes it (one
        release per distinct id, matching the one pin per id that the proxy's encode took).
    """

    url: str
    auth_token: str | None = field(default=None, repr=False)
    shm: str = "auto"
    shm_dir: str = DEFAULT_DIR
    max_staged_bytes: int = 1 << 30
    arena_bytes: int = 128 << 20
    fetch_threads: int = 4
    fetch_timeout_s: float = 60.0
    wait_timeout_s: float = 120.0
    release_on_finish: bool = True

    def __post_init__(self):
        scheme = urlsplit(self.url).scheme
        if scheme not in ("http", "https", "grpc") or not urlsplit(self.url).netloc:
            raise ValueError(f"url must be http://host:port or grpc://host:port, got {self.url!r}")
        if self.shm not in SHM_MODES:
            raise ValueError(f"shm must be one of {', '.join(SHM_MODES)}, got {self.shm!r}")
        if not os.path.isabs(self.shm_dir):
            raise ValueError(f"shm_dir must be an absolute path, got {self.shm_dir!r}")
        for name in ("max_staged_bytes", "arena_bytes", "fetch_threads", "fetch_timeout_s", "wait_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def transport(self) -> str:
        return "grpc" if urlsplit(self.url).scheme == "grpc" else "http"

    @classmethod
    def from_extra_config(cls, extra: Mapping) -> ConnectorOptions:
        """Parse `ec_connector_extra_config` (JSON values: strings, numbers, booleans); ValueError naming the
        key for anything unknown or malformed."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"ec_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if not extra.get("url"):
            raise ValueError("ec_connector_extra_config: 'url' (the encoder service, http://... or grpc://...) "
                             "is required")
        parsers: dict[str, Callable] = {
            "url": str, "auth_token": lambda v: str(v) if v else None, "shm": _shm_mode, "shm_dir": str,
            "max_staged_bytes": _size, "arena_bytes": _size, "fetch_threads": int,
            "fetch_timeout_s": float, "wait_timeout_s": float,
            "release_on_finish": lambda v: v if isinstance(v, bool) else parse_bool(v)}
        values = {}
        for key, value in extra.items():
            try:
                values[key] = parsers[key](value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"ec_connector_extra_config[{key!r}]: {exc}") from None
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"ec_connector_extra_config: {exc}") from None


def _size(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else parse_size(value)


def _shm_mode(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    return text if text in SHM_MODES else ("on" if parse_bool(text) else "off")


def expected_row_width(config) -> int:
    """Row width the model's language side takes from its vision tower: Qwen2/2.5-VL `out_hidden_size`,
    Qwen3-VL `out_hidden_size * (1 + len(deepstack_visual_indexes))` (the layout our rows already have).
    `config`: the checkpoint's config.json as a dict, or a transformers config (vLLM's hf_config)."""
    from encoder_service.models.registry import resolve

    as_dict = config if isinstance(config, dict) else config.to_dict()
    return resolve(as_dict).config.spec().row_width


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


# ---- what travels to the worker -------------------------------------------------------------------------
@dataclass(frozen=True)
class ShmRows:
    """Where an item's staged rows are: `num_rows` rows of `row_width` `dtype` values at byte `offset` of
    the file `directory/name`. Plain and picklable (it rides in vLLM's scheduler output)."""

    name: str
    directory: str
    offset: int
    num_rows: int
    row_width: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_width * torch_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ItemLoad:
    """One item for a worker to load this step: vLLM's key and the rows it planned, and where they are."""

    identifier: str
    num_rows: int
    rows: ShmRows


class _Mapped:
    """A staging file mapped in a worker (MAP_SHARED, read as written by the scheduler's process)."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = False

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        self.bytes = None
        self.mm.close()


class RowLoader:
    """Worker side: staged rows onto this worker's device, `[num_rows, row_width]` in `dtype`.

    The scheduler side stages items in a few large files (arenas), so a worker keeps each file mapped
    (`retain` unmaps those no longer in use). On CUDA a mapping is registered with the driver
    (cudaHostRegister: page-locked), so the copy is a DMA that does not stall the host; without it (or if
    registration fails) it is an ordinary pageable copy.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype | None = None, *, pin: bool = True):
        self.device, self.dtype = torch.device(device), dtype
        self.pin = pin and self.device.type == "cuda"
        self._maps: dict[str, _Mapped] = {}

    def load(self, load: ItemLoad, row_width: int | None = None) -> torch.Tensor:
        """The item's rows on the device. `row_width`: what the model takes; the staged rows must have
        exactly vLLM's planned row count and that width, else RuntimeError (nothing is loaded)."""
        rows = load.rows
        if rows.num_rows != load.num_rows or (row_width is not None and rows.row_width != row_width):
            raise RuntimeError(f"staged rows of {load.identifier} are {rows.num_rows} x {rows.row_width}, the "
                               f"model planned {load.num_rows} x {row_width}: not loading them")
        m = self._map(rows)
        src_dtype = torch_dtype(rows.dtype)
        src = m.bytes[rows.offset:rows.offset + rows.nbytes].view(src_dtype).view(rows.num_rows, rows.row_width)
        out = torch.empty((rows.num_rows, rows.row_width), dtype=src_dtype, device=self.device)
        out.copy_(src, non_blocking=m.registered)
        return out if self.dtype in (None, src_dtype) else out.to(self.dtype)

    def retain(self, names: Iterable[str]) -> None:
        """Unmap the files not in `names` (the arenas the scheduler side still has)."""
        keep = set(names)
        stale = [n for n in self._maps if n not in keep]
        if stale and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # copies from those mappings may still be in flight
        for name in stale:
            self._maps.pop(name).close()

    def close(self) -> None:
        self.retain(())

    def _map(self, rows: ShmRows) -> _Mapped:
        if not NAME_RE.match(rows.name):
            raise RuntimeError(f"not a staging file name: {rows.name!r}")
        m = self._maps.get(rows.name)
        if m is None:  # an arena never changes size: one mapping per file for as long as it is in use
            m = self._maps[rows.name] = _Mapped(os.path.join(rows.directory, rows.name))
            if self.pin:
                try:
                    err = torch.cuda.cudart().cudaHostRegister(m.bytes.data_ptr(), m.size, 0)
                    m.registered = int(getattr(err, "value", err)) == 0
                except Exception as exc:  # noqa: BLE001 - pageable copies work too
                    err = exc
                if not m.registered:
                    log.warning("cudaHostRegister of %s failed (%s): pageable copies from now on", rows.name, err)
                    self.pin = False
        if m.size < rows.offset + rows.nbytes:
            raise RuntimeError(f"{rows.name} is {m.size} bytes, the staged rows end at {rows.offset + rows.nbytes}")
        return m


# ---- host staging: arenas of rows in shared memory -------------------------------------------------------
@dataclass(eq=False)
class _Arena:
    rows: torch.Tensor  # [capacity, width] in a shared-memory file of ours
    name: str
    free: list[list[int]]  # sorted [start, length] runs of free rows
    used: int = 0

    def take(self, n: int) -> int | None:
        for run in self.free:
            if run[1] >= n:
                start = run[0]
                run[0] += n
                run[1] -= n
                if run[1] == 0:
                    self.free.remove(run)
                self.used += n
                return start
        return None

    def give(self, start: int, n: int) -> None:
        self.used -= n
        self.free.append([start, n])
        self.free.sort()
        merged = [self.free[0]]
        for s, length in self.free[1:]:
            if merged[-1][0] + merged[-1][1] == s:
                merged[-1][1] += length
            else:
                merged.append([s, length])
        self.free = merged


@dataclass(eq=False)
class StagedRows:
    """One item's rows in an arena: `rows` is the `[num_rows, row_width]` view, `ref` what a worker needs."""

    item_id: str
    rows: torch.Tensor
    ref: ShmRows
    arena: _Arena
    start: int
    span: int  # rows taken in the arena (num_rows + 1: the guard row)

    @property
    def nbytes(self) -> int:
        return self.ref.nbytes


class RowArenas:
    """Row ranges in a few large shared-memory files (`ShmBuffers.alloc_rows`), reused item after item: the
    encoder keeps each file mapped (its pages faulted in once), and so does every worker (RowLoader).

    A new arena holds max(arena_bytes, the item) and is created only when no arena has room; an arena that
    empties is unlinked unless it is the only one. Ranges of a failed fetch are quarantined for `quarantine_s`
    (the encoder may still be writing a timed-out fetch into them). Thread-safe."""

    def __init__(self, buffers, arena_bytes: int, quarantine_s: float, clock: Callable[[], float] = time.monotonic):
        self._buffers, self.arena_bytes, self.quarantine_s, self._clock = buffers, arena_bytes, quarantine_s, clock
        self._lock = threading.Lock()
        self._arenas: list[_Arena] = []
        self._quarantine: list[tuple[float, _Arena, int, int]] = []

    def take(self, num_rows: int, width: int, dtype: str) -> tuple[_Arena, int]:
        with self._lock:
            self._thaw()
            for arena in self._arenas:
                if arena.rows.shape[1] == width and arena.rows.dtype == torch_dtype(dtype):
                    start = arena.take(num_rows)
                    if start is not None:
                        return arena, start
            capacity = max(num_rows, self.arena_bytes // (width * torch_dtype(dtype).itemsize))
            rows = self._buffers.alloc_rows(capacity, width, dtype)
            arena = _Arena(rows, self._buffers.locate(rows)[0], [[0, capacity]])
            self._arenas.append(arena)
            return arena, arena.take(num_rows)

    def give(self, arena: _Arena, start: int, n: int, quarantine: bool = False) -> None:
        with self._lock:
            if quarantine:
                self._quarantine.append((self._clock() + self.quarantine_s, arena, start, n))
                return
            arena.give(start, n)
            if arena.used == 0 and len(self._arenas) > 1 and not any(q[1] is arena for q in self._quarantine):
                self._arenas.remove(arena)  # the last view: the file is unlinked once its mapping goes

    def names(self) -> list[str]:
        with self._lock:
            return [a.name for a in self._arenas]

    def _thaw(self) -> None:  # under _lock
        now = self._clock()
        thawed = [q for q in self._quarantine if q[0] <= now]
        self._quarantine = [q for q in self._quarantine if q[0] > now]
        for _, arena, start, n in thawed:
            arena.give(start, n)


# ---- fetching ---------------------------------------------------------------------------------------------
class RowFetcher:
    """Fetches items' rows from the encoder service into our arenas (scheduler side; also the benchmark's).

    Thread-safe: `fetch` blocks (call it from worker threads). `mode` is "shm" (the encoder writes into our
    file), "http" or "grpc" (our client writes what the socket brings). With shm "auto", an encoder that
    can't reach our files (another container's /dev/shm) turns the fetcher to the socket once, logged.
    """

    def __init__(self, options: ConnectorOptions, expected_width: int | None = None):
        from encoder_service.client.shm import ShmBuffers

        self.options, self.expected_width = options, expected_width
        self._buffers = ShmBuffers(options.shm_dir)
        self.arenas = RowArenas(self._buffers, options.arena_bytes, options.fetch_timeout_s)
        self._lock = threading.Lock()
        self._clients: dict[bool, object] = {}  # shm? -> EncoderClient
        self._meta: dict | None = None
        self._shm: bool | None = None if options.shm == "auto" else options.shm == "on"

    @property
    def mode(self) -> str:
        return "shm" if self._shm else self.options.transport

    def _client(self, shm: bool):
        with self._lock:
            if shm not in self._clients:
                from encoder_service.client.base import EncoderClient

                o = self.options
                if o.transport == "grpc":
                    from encoder_service.client.grpc_transport import GrpcTransport

                    transport = GrpcTransport(urlsplit(o.url).netloc, token=o.auth_token)
                else:
                    from encoder_service.client.http import HttpTransport

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
        log.info("encoder service %s (%s, rows %d wide, %s): fetching over %s", self.options.url, family, width,
                 meta["dtype"], self.mode)
        self._meta = meta
        return meta

    def fetch(self, item_id: str, num_rows: int) -> StagedRows:
        """Item `item_id`'s rows, exactly `num_rows` of them, staged in an arena; ItemUnavailable else."""
        meta = self.metadata()
        width, dtype = int(meta["row_width"]), meta["dtype"]
        # One row more than planned: an item with more rows than vLLM planned shows as num_rows + 1.
        span = num_rows + 1
        arena, start = self.arenas.take(span, width, dtype)
        ok = False
        try:
            got = self._fetch_into(item_id, num_rows, arena.rows[start:start + span])
            if got != num_rows:
                more = "more than " if got > num_rows else ""
                raise ItemUnavailable(
                    f"item {item_id!r} has {more}{min(got, num_rows)} rows at the encoder service, vLLM planned "
                    f"{num_rows} placeholder tokens for it: the image_grid_thw sent to vLLM must be the one our "
                    "encode answered, and both sides must use the same merge size")
            ok = True
        except ItemUnavailable:
            raise
        except errors.NotFound as exc:
            raise ItemUnavailable(f"item {item_id!r} is not at the encoder service ({exc}): unknown, or evicted "
                                  "after its lease; the request's image uuid must be the id our encode answered, "
                                  "and vLLM keeps a uuid only when the request has no mm_processor_kwargs and the "
                                  "server no --media-io-kwargs for images") from None
        except errors.EncoderServiceError as exc:
            raise ItemUnavailable(f"fetch of item {item_id!r} from {self.options.url} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the wire, a file: the request fails, the engine goes on
            raise ItemUnavailable(f"fetch of item {item_id!r} failed: {type(exc).__name__}: {exc}") from None
        finally:
            if not ok:  # the encoder may still write a timed-out fetch: the range rests a while
                self.arenas.give(arena, start, span, quarantine=True)
        offset = start * arena.rows.stride(0) * arena.rows.element_size()
        ref = ShmRows(arena.name, self.options.shm_dir, offset, num_rows, width, dtype)
        return StagedRows(item_id, arena.rows[start:start + num_rows], ref, arena, start, span)

    def drop(self, staged: StagedRows) -> None:
        """The item's range back to its arena (no worker may read it any more)."""
        self.arenas.give(staged.arena, staged.start, staged.span)

    def _fetch_into(self, item_id: str, num_rows: int, out: torch.Tensor) -> int:
        shm = bool(self._shm)
        try:
            result = self._client(shm).fetch([(item_id, 0)], 0, num_rows + 1, out=out)
        except (errors.InvalidInput, errors.FailedPrecondition) as exc:
            if not (shm and self.options.shm == "auto" and "shm" in str(exc)):
                raise
            log.warning("encoder service %s can't write into our shared memory (%s); fetching over the socket "
                        "from now on", self.options.url, exc)
            self._shm = False
            result = self._client(False).fetch([(item_id, 0)], 0, num_rows + 1, out=out)
        segments = [s for s in result.segments if s.id == item_id]
        if len(segments) != 1 or segments[0].row_start != 0 or segments[0].position != 0:
            raise ItemUnavailable(f"fetch of item {item_id!r}: unexpected segments {result.segments}")
        return segments[0].num_rows

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
        self._buffers.close()  # unlinks every file (tensors still viewing them keep their mappings)


# ---- scheduler-side state ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Need:
    """An item a request still needs: vLLM's key, our id, and the rows vLLM planned for its placeholder."""

    identifier: str
    item_id: str
    num_rows: int


PENDING, READY = "pending", "ready"


@dataclass(eq=False)
class _Entry:
    item_id: str
    num_rows: int
    nbytes: int  # estimated until staged
    state: str = PENDING
    staged: StagedRows | None = None
    waiting: set[str] = field(default_factory=set)  # requests that need it and have not had it allocated
    held: bool = False  # vLLM holds it in its encoder cache (a load was queued, no free since)


class StagingTable:
    """The scheduler side, vLLM-free: which items are staged, fetches ahead of need, loads for the workers.

    Every method runs on the scheduler's thread; fetches run on `fetch_threads` threads and report back
    through a queue that `ensure` and `end_step` drain, so a hook never waits on the network.
      ensure(request_id, needs) -> bool   True when every needed item is staged (vLLM may schedule it);
                                          starts missing fetches, fails the request on a bad item
      has(identifier) -> bool             staged (vLLM's has_cache_item)
      allocated(request_id, identifier)   vLLM took the item for this request: queue its load
      end_step(freed) -> [ItemLoad]       the step's loads; forget items vLLM evicted (free_encoder_mm_hashes)
      take_failed() -> set[str]           requests to fail, each reported once
      finished(request_id, item_ids)      the request is done: release its pins
    """

    def __init__(self, fetcher: RowFetcher, clock: Callable[[], float] = time.monotonic):
        self.fetcher, self.options, self._clock = fetcher, fetcher.options, clock
        self._pool = ThreadPoolExecutor(max_workers=self.options.fetch_threads, thread_name_prefix="encsvc-fetch")
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._entries: dict[str, _Entry] = {}  # item id -> entry
        self._item_of: dict[str, str] = {}  # vLLM identifier -> our item id
        self._since: dict[str, float] = {}  # request -> when it started waiting
        self._failed: dict[str, str] = {}  # request -> why, not yet reported
        self._reported: set[str] = set()  # failed and reported; until finished
        self._loads: dict[str, ItemLoad] = {}
        self.counters = dict(fetches=0, fetch_failures=0, loads=0, staged_bytes=0, failed_requests=0)

    # -- hooks -------------------------------------------------------------------------------------------
    def ensure(self, request_id: str, needs: Iterable[Need]) -> bool:
        self._drain()
        if request_id in self._failed or request_id in self._reported:
            return False
        ready = True
        for need in needs:
            self._item_of[need.identifier] = need.item_id
            entry = self._entries.get(need.item_id)
            if entry is None:
                entry = self._start(need)
                if entry is None:  # over the staging budget: retried on a later step
                    ready = False
                    continue
            entry.waiting.add(request_id)
            if entry.state != READY:
                ready = False
            elif entry.num_rows != need.num_rows:
                self.fail(request_id, f"item {need.item_id!r} was staged with {entry.num_rows} rows, this "
                                      f"request's placeholder has {need.num_rows}")
                return False
        if ready:
            self._since.pop(request_id, None)
            return True
        waited = self._clock() - self._since.setdefault(request_id, self._clock())
        if waited > self.options.wait_timeout_s:
            self.fail(request_id, f"its items were not staged within {self.options.wait_timeout_s:g} s")
        return False

    def has(self, identifier: str) -> bool:
        entry = self._entries.get(self._item_of.get(identifier, identifier))
        return entry is not None and entry.state == READY

    def allocated(self, request_id: str, identifier: str, num_rows: int) -> None:
        entry = self._entries.get(self._item_of.get(identifier, identifier))
        if entry is None or entry.state != READY:
            # vLLM allocated an item we don't have: it plans a local encode (no pixels on a consumer).
            self.fail(request_id, f"vLLM scheduled item {identifier!r} before it was staged")
            log.error("item %s allocated by vLLM for %s but not staged here", identifier, request_id)
            return
        entry.waiting.discard(request_id)
        entry.held = True
        self._loads.setdefault(identifier, ItemLoad(identifier, num_rows, entry.staged.ref))

    def end_step(self, freed: Iterable[str] = ()) -> list[ItemLoad]:
        self._drain()
        loads, self._loads = list(self._loads.values()), {}
        self.counters["loads"] += len(loads)
        for identifier in freed:
            entry = self._entries.get(self._item_of.get(identifier, identifier))
            if entry is not None:
                entry.held = False
        for item_id in [i for i, e in self._entries.items() if e.state == READY and not e.held and not e.waiting]:
            self._drop(item_id)
        return loads

    def take_failed(self) -> set[str]:
        failed = set(self._failed)
        self._reported |= failed
        self._failed.clear()
        return failed

    def fail(self, request_id: str, why: str) -> None:
        if request_id in self._failed or request_id in self._reported:
            return
        log.error("encoder_service connector: failing request %s: %s", request_id, why)
        self._failed[request_id] = why
        self.counters["failed_requests"] += 1
        self._since.pop(request_id, None)
        for entry in self._entries.values():
            entry.waiting.discard(request_id)

    def finished(self, request_id: str, item_ids: Iterable[str] = ()) -> None:
        self._since.pop(request_id, None)
        self._failed.pop(request_id, None)
        self._reported.discard(request_id)
        for entry in self._entries.values():
            entry.waiting.discard(request_id)
        ids = sorted(set(item_ids))
        if ids and self.options.release_on_finish:
            self._pool.submit(self.fetcher.release, ids)

    def why(self, request_id: str) -> str | None:
        return self._failed.get(request_id)

    def staged_bytes(self) -> int:
        return sum(e.staged.nbytes for e in self._entries.values() if e.staged is not None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for item_id in list(self._entries):
            self._drop(item_id)
        self.fetcher.close()

    # -- internals -------------------------------------------------------------------------------------------
    def _ahead_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if not e.held)

    def _start(self, need: Need) -> _Entry | None:
        width = self.fetcher.expected_width or 0
        nbytes = (need.num_rows + 1) * width * 2
        ahead = self._ahead_bytes()
        if ahead and ahead + nbytes > self.options.max_staged_bytes:
            return None
        entry = _Entry(need.item_id, need.num_rows, nbytes)
        self._entries[need.item_id] = entry
        self.counters["fetches"] += 1
        self._pool.submit(self._fetch, entry)
        return entry

    def _fetch(self, entry: _Entry) -> None:
        try:
            result = self.fetcher.fetch(entry.item_id, entry.num_rows)
        except ItemUnavailable as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - reported as the item's failure, not lost on a thread
            result = ItemUnavailable(f"fetch of item {entry.item_id!r} failed: {type(exc).__name__}: {exc}")
        self._done.put((entry, result))

    def _drain(self) -> None:
        while True:
            try:
                entry, result = self._done.get_nowait()
            except queue.Empty:
                return
            if self._entries.get(entry.item_id) is not entry:  # dropped meanwhile (closed)
                if isinstance(result, StagedRows):
                    self.fetcher.drop(result)
                continue
            if isinstance(result, StagedRows):
                entry.staged, entry.state, entry.nbytes = result, READY, result.nbytes
                self.counters["staged_bytes"] += result.nbytes
                continue
            self.counters["fetch_failures"] += 1
            del self._entries[entry.item_id]  # a later request for the id tries again
            for request_id in sorted(entry.waiting):
                self.fail(request_id, str(result))

    def _drop(self, item_id: str) -> None:
        entry = self._entries.pop(item_id, None)
        if entry is not None and entry.staged is not None:
            self.fetcher.drop(entry.staged)
            entry.staged = None
