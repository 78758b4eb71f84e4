"""EncoderCore: the one core that HTTP and gRPC adapt (see docs/interfaces.md, "Service core").

encode: hash the raw bytes (cache key) and read the image header (probe + plan) on CPU threads, pin each id
for its lease, and answer per image (id, grid_thw, num_tokens, ...) before the ViT runs. Misses go through
the store's single flight; the fill submits the image to the engine, which decodes it on a CPU thread and
runs it on the GPU thread. `wait=True` waits for the rows (and can return them).
fetch: per chunk [start, end), `ranges.plan_chunk` picks the overlapping rows of each image; the store
reads only those (waiting, up to the timeout, for images still encoding). With a `ShmTarget` the rows go
into the client's shared-memory file instead of the result (api/shm.py).
release: drop the encode pins of ids the caller is done with (leases end early).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from encoder_service import errors
from encoder_service.api import shm as shm_mod
from encoder_service.api.metrics import Metrics
from encoder_service.api.shm import ShmTarget
from encoder_service.api.urls import UrlFetcher
from encoder_service.api.wire import WireHeader
from encoder_service.cache import EmbeddingStore, Entry, caller_key, key_from_id, make_key, model_fingerprint
from encoder_service.engine.engine import Engine, Job
from encoder_service.engine.scheduler import WorkItem
from encoder_service.ranges import Segment, plan_chunk
from encoder_service.settings import Settings

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class ImageInput:  # exactly one of data / url
    data: bytes | None = None
    url: str | None = None
    caller_id: str | None = None  # optional caller-supplied id (own namespace, "u:<id>")


@dataclass(frozen=True)
class ImageInfo:  # answered once the header is read and sized
    id: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    row_width: int
    hidden_size: int
    layout: str
    dtype: str
    cached: bool


@dataclass
class EncodeResult:
    images: list[ImageInfo]
    embeddings: list[torch.Tensor] | None = None  # per image [num_tokens, row_width], CPU, when asked
    timings: dict[str, float] = field(default_factory=dict)  # ms


def timing_headers(timings: dict[str, float]) -> tuple[tuple[str, str], ...]:
    """`timings` as (key, value) pairs, for HTTP headers and gRPC trailing metadata alike:
    x-timing-<name>-ms, e.g. x-timing-decode-ms, x-timing-queue-ms, x-timing-encode-ms."""
    return tuple((f"x-timing-{k.removesuffix('_ms').replace('_', '-')}-ms", f"{v:.3f}") for k, v in timings.items())


@dataclass(frozen=True)
class FetchItem:
    id: str
    offset: int  # the image's first placeholder position in the prompt


@dataclass
class FetchResult:
    segments: list[Segment]  # placeholder order; rows of segment k follow those of segment k-1
    rows: torch.Tensor | None  # [sum rows, row_width], CPU, contiguous; None when written to shared memory
    dtype: str
    row_width: int
    layout: str
    timings: dict[str, float] = field(default_factory=dict)
    shm_bytes: int | None = None  # bytes written into the caller's ShmTarget

    def header(self) -> WireHeader:
        """The wire header (api/wire.py) of this result; with rows, checked against the segments."""
        if self.rows is not None:
            return WireHeader.of(self.segments, self.rows, self.layout)
        return WireHeader(self.dtype, self.row_width, self.layout, tuple(self.segments))


@dataclass
class _Probed:
    key: object  # CacheKey
    grid_thw: tuple[int, int, int]
    num_tokens: int
    data: bytes


class EncoderCore:
    """Built by `build_core(settings)` (api/service.py); `start()` warms up, then `ready()` turns true."""

    def __init__(self, settings: Settings, *, loaded, runner, preprocess_cfg, store: EmbeddingStore,
                 metrics: Metrics | None = None):
        from encoder_service import preprocessing

        self._pp = preprocessing
        self.settings = settings
        self.loaded, self.runner, self.spec = loaded, runner, loaded.spec
        self._pin_inputs = torch.device(loaded.device).type == "cuda"  # pinned host memory needs CUDA
        self.preprocess_cfg = preprocess_cfg
        self.store = store
        self.metrics = metrics or Metrics()
        lim = settings.limits
        self.limits = preprocessing.ImageLimits(max_image_bytes=lim.max_image_bytes, max_pixels=lim.max_pixels)
        self.dtype = _DTYPE_NAMES[loaded.dtype] if isinstance(loaded.dtype, torch.dtype) else str(loaded.dtype)
        self.model_fp = model_fingerprint(loaded.fingerprint, self.spec.family, self.dtype, preprocess_cfg,
                                          layout=self.spec.layout)
        self.engine = Engine(runner.encode, batch_tokens=settings.engine.batch_tokens, buckets=runner.buckets,
                             max_queue=settings.engine.max_queue, metrics=self.metrics)
        self.urls = UrlFetcher(lim.allow_url_hosts, max_bytes=lim.max_image_bytes)
        srv = settings.server
        self.shm = shm_mod.ShmWriter(srv.shm_dir) if srv.shm_fetch else None  # None: shm fetch is off
        self._planned: dict[str, tuple[tuple[int, int, int], int]] = {}  # in-flight name -> (grid, num_tokens)
        self._items: dict[str, WorkItem] = {}  # in-flight name -> its engine item
        self._interest: dict[str, int] = {}  # in-flight name -> requests still wanting it
        self._fills: dict[str, int] = {}  # in-flight name -> fill tasks of this core
        self._failures: OrderedDict[str, errors.EncoderServiceError] = OrderedDict()  # recent failed encodes
        self._reserved = 0  # queue slots promised to fills that have not submitted yet
        self._ready = False
        self._draining = False
        self._started = False

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self, *, warmup: bool = True) -> None:
        """Start the store and engine, then run a real tiny encode through the whole engine."""
        await self.store.start()
        await self.engine.start()
        self._started = True
        if warmup:
            t0 = time.perf_counter()
            data = warmup_image(self.spec.factor)
            await self.engine.run_one(Job(lambda: self._prepare(data, None), 0), timeout_s=600)
            log.info("warm-up encode through the engine took %.1f ms", (time.perf_counter() - t0) * 1e3)
        self._ready = True

    def drain(self) -> None:
        """Readiness off for good (probes and gRPC Health say NOT_SERVING, so traffic moves elsewhere);
        requests still arriving are served until the transports stop."""
        self._draining = True

    async def stop(self) -> None:
        self._ready = False
        if self._started:
            await self.engine.stop()
        await self.urls.close()
        await self.store.close()
        if self.shm is not None:
            await asyncio.to_thread(self.shm.close)  # waits for copies in flight

    def live(self) -> bool:
        return not self._started or self.engine.alive

    def ready(self) -> bool:
        return self._ready and not self._draining and self.engine.alive

    def metadata(self) -> dict:
        s, spec = self.settings, self.spec
        return {
            "model": s.model.model, "family": spec.family, "model_type": spec.model_type,
            "fingerprint": self.model_fp, "dtype": self.dtype, "device": str(self.loaded.device),
            "row_width": spec.row_width, "hidden_size": spec.out_hidden_size, "num_deepstack": spec.num_deepstack,
            "layout": spec.layout, "patch_size": spec.patch_size, "merge_size": spec.merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "min_pixels": self.preprocess_cfg.min_pixels, "max_pixels": self.preprocess_cfg.max_pixels,
            "runner": self.runner.describe(), "buckets": list(self.runner.buckets),
            "batch_tokens": s.engine.batch_tokens, "max_queue": s.engine.max_queue,
            "cache": {"local_bytes": s.cache.cache_bytes, "redis": s.cache.redis_url is not None, "hash": s.cache.hash, "lease_s": s.cache.lease_s},
            "limits": {"max_images": s.limits.max_images, "max_body_bytes": s.limits.max_body_bytes,
                       "max_image_bytes": s.limits.max_image_bytes, "max_pixels": s.limits.max_pixels,
                       "url_images": bool(s.limits.allow_url_hosts)},
            "shm_fetch": self.shm is not None,
        }

    # ---- encode ----------------------------------------------------------------------------------------
    async def encode(self, images: list[ImageInput], *, wait: bool = False, return_embeddings: bool = False,
                     timeout_s: float | None = None) -> EncodeResult:
        t0 = time.perf_counter()
        self._check_serving()
        n, limit = len(images), self.settings.limits.max_images
        if n == 0:
            raise errors.InvalidInput("no images in the request")
        if n > limit:
            raise errors.LimitExceeded("number of images in the request", n, limit)
        wait = wait or return_embeddings
        datas = await asyncio.gather(*(self._image_bytes(i, img) for i, img in enumerate(images)))
        t_read = time.perf_counter()
        loop = asyncio.get_running_loop()
        probed: list[_Probed] = await asyncio.gather(*(
            loop.run_in_executor(self.engine.cpu_pool, self._probe, i, data, img.caller_id)
            for i, (data, img) in enumerate(zip(datas, images))))
        t_probe = time.perf_counter()
        timings = {"read_ms": (t_read - t0) * 1e3, "decode_ms": (t_probe - t_read) * 1e3}

        unique: dict[str, _Probed] = {}
        for p in probed:
            unique.setdefault(p.key.name, p)
        hits = {name: self.store.peek(name) for name in unique}
        for name, entry in hits.items():  # a caller id may name other bytes than this time: trust the entry
            if entry is not None:
                unique[name] = dataclasses.replace(unique[name], grid_thw=entry.header.grid_thw,
                                                   num_tokens=entry.num_rows)
        cached = {name: entry is not None for name, entry in hits.items()}
        misses = [name for name in unique if not cached[name] and name not in self._items]
        self._reserve(len(misses))
        pinned: list[str] = []
        try:
            for name, p in unique.items():
                self.store.pin(p.key, nbytes=p.num_tokens * self._row_bytes)
                pinned.append(name)
        except errors.Overloaded:
            self._reserved -= len(misses)
            for name in pinned:
                self.store.release(name)
            raise
        for name in unique:
            if cached[name]:
                self.metrics.cache_hits.labels(tier="local").inc()

        fills = {name: self._start_fill(p, name in misses, timings) for name, p in unique.items()}
        infos = [self._info(unique[p.key.name], cached[p.key.name]) for p in probed]
        result = EncodeResult(images=infos, timings=timings)
        if wait:
            done = await self._await_fills(fills, timeout_s, t0)  # name -> (entry, created by this request)
            result.images = [dataclasses.replace(i, cached=i.cached or not done[p.key.name][1])
                             for i, p in zip(infos, probed)]
            if return_embeddings:
                result.embeddings = [done[p.key.name][0].tensor for p in probed]
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        return result

    @property
    def _row_bytes(self) -> int:
        return self.spec.row_width * torch.empty((), dtype=self.loaded.dtype).element_size()

    def _info(self, p: _Probed, cached: bool) -> ImageInfo:
        spec = self.spec
        return ImageInfo(id=p.key.id, grid_thw=tuple(p.grid_thw), num_tokens=p.num_tokens,
                         row_width=spec.row_width, hidden_size=spec.out_hidden_size, layout=spec.layout,
                         dtype=self.dtype, cached=cached)

    async def _image_bytes(self, index: int, img: ImageInput) -> bytes:
        if (img.data is None) == (img.url is None):
            raise errors.InvalidInput(f"image {index}: give exactly one of data or url")
        if img.url is not None:
            return await self.urls.fetch(img.url, index)
        if len(img.data) == 0:
            raise errors.ImageDecodeError(f"image {index}: empty image data (0 bytes)")
        return img.data

    def _probe(self, index: int, data: bytes, caller_id: str | None) -> _Probed:
        """CPU thread: content hash (or caller key) and header-only sizing of one image."""
        try:
            header = self._pp.probe(data, self.limits)
            plan = self._pp.plan(header, self.preprocess_cfg)
        except errors.EncoderServiceError as exc:
            exc.message = f"image {index}: {exc.message}"
            exc.args = (exc.message,)
            raise
        if caller_id is not None:
            key = caller_key(caller_id, self.model_fp)
        else:
            key = make_key(data, self.model_fp, self.settings.cache.hash)
        return _Probed(key, tuple(int(x) for x in plan.grid_thw), int(plan.num_tokens), data)

    def _reserve(self, n: int) -> None:
        """All-or-none admission of a request's misses into the engine queue (429 when full)."""
        eng = self.engine
        waiting = eng.queue_depth + self._reserved
        if n and waiting + n > eng.max_queue:
            raise errors.Overloaded(f"encode queue is full: {waiting} images waiting, max_queue is "
                                    f"{eng.max_queue}, this request adds {n}", retry_after_s=eng.retry_after_s())
        self._reserved += n

    def _start_fill(self, p: _Probed, reserved: bool, timings: dict) -> asyncio.Task:
        """Run (or join) the store's single flight for p.key; a new fill submits p to the engine."""
        name = p.key.name
        state = {"reserved": reserved}
        self._failures.pop(name, None)
        self._want(name, +1)
        self._planned.setdefault(name, (p.grid_thw, p.num_tokens))
        self._fills[name] = self._fills.get(name, 0) + 1

        async def create() -> Entry:
            if state.pop("reserved", False):
                self._reserved -= 1
            state["created"] = True
            self.metrics.cache_misses.inc()
            job = Job(lambda: self._prepare(p.data, p.grid_thw), p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2])
            (item,) = self.engine.submit([job], deadline=self._deadline())
            item.interest = max(1, self._interest.get(name, 1))
            self._items[name] = item
            try:
                encoded = await item.future
            finally:
                self._items.pop(name, None)
            timings.update({k: v for k, v in encoded.timings.items() if k.endswith("_ms")})
            # The engine's rows are owned host tensors: the entry takes them without a copy.
            return Entry.from_rows(encoded.rows, encoded.grid_thw, self.spec.layout, copy=False)

        async def fill() -> tuple[Entry, bool]:
            try:
                entry, _ = await self.store.get_or_create(p.key, create)
                if reserved and not state.get("created"):  # a local miss served by Redis or a joined flight
                    self.metrics.cache_hits.labels(tier="redis" if self.store.redis else "inflight").inc()
                return entry, state.get("created", False)
            except errors.EncoderServiceError as exc:
                self._remember_failure(name, exc)
                raise
            finally:
                if state.pop("reserved", False):  # a Redis hit or a joined flight: create() never ran
                    self._reserved -= 1
                self._fills[name] -= 1
                if self._fills[name] == 0:  # the last of this id's fills: the entry (if any) is stored
                    del self._fills[name]
                    self._planned.pop(name, None)
                    self._interest.pop(name, None)

        task = asyncio.create_task(fill(), name=f"encode {p.key.id}")
        task.add_done_callback(_log_fill_failure)
        return task

    def _want(self, name: str, delta: int) -> None:
        """Count the requests that still want an in-flight id; at zero its queued item is dropped."""
        if name not in self._interest and delta < 0:
            return
        self._interest[name] = max(0, self._interest.get(name, 0) + delta)
        item = self._items.get(name)
        if item is not None:
            item.interest = self._interest[name]

    def _remember_failure(self, name: str, exc: errors.EncoderServiceError) -> None:
        self._failures[name] = exc
        while len(self._failures) > 4096:
            self._failures.popitem(last=False)

    def _deadline(self) -> float:
        """Background encodes stay wanted for the lease: past it nobody holds the id any more."""
        return time.monotonic() + self.settings.cache.lease_s

    async def _await_fills(self, fills: dict[str, asyncio.Task], timeout_s: float | None, t0: float) -> dict:
        try:
            entries = await asyncio.wait_for(asyncio.gather(*(asyncio.shield(t) for t in fills.values())),
                                             timeout_s)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"encode did not finish within timeout_s={timeout_s} (waited {time.perf_counter() - t0:.3f}s)"
            ) from None
        except asyncio.CancelledError:
            for name in fills:  # the caller left: its images are not wanted by it any more
                self._want(name, -1)
                self.store.release(name)
            raise
        return dict(zip(fills, entries))

    def _prepare(self, data: bytes, grid_thw) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """CPU thread: full decode + resize + patchify; the grid must match what encode answered."""
        pre = self._pp.preprocess(data, self.preprocess_cfg, self.limits)
        grid = tuple(int(x) for x in pre.grid_thw)
        if grid_thw is not None and grid != tuple(grid_thw):
            raise errors.ImageDecodeError(f"decoded image has grid {grid}, its header promised {tuple(grid_thw)}")
        # Cast here, not on the GPU: the patch embedding casts to the model dtype first thing, and the cast
        # rounds the same on either side, so bf16 halves the host-to-device bytes at no cost in parity.
        # Pinned memory makes that copy asynchronous on the GPU thread.
        pixel_values = pre.pixel_values.to(self.loaded.dtype)
        if self._pin_inputs:
            pixel_values = pixel_values.pin_memory()
        return pixel_values, grid

    def _check_serving(self) -> None:
        if not self._ready:
            raise errors.Unavailable("the service is not ready (model loading or warm-up)")
        if not self.engine.alive:
            raise errors.Unavailable("the encode engine is down")

    # ---- fetch -----------------------------------------------------------------------------------------
    async def fetch(self, items: list[FetchItem], start: int, end: int, timeout_s: float | None = None,
                    shm: ShmTarget | None = None) -> FetchResult:
        """The rows of `items` inside [start, end); with `shm`, written into that client file instead (the
        target is checked before any wait for rows) and the result carries `shm_bytes`, no rows."""
        t0 = time.perf_counter()
        self._check_serving()
        if shm is not None and self.shm is None:
            raise shm_mod.disabled()
        if not items:
            raise errors.InvalidInput("no items in the fetch")
        self._check_id_count("fetch items", len(items))
        keys = {it.id: key_from_id(it.id, self.model_fp, self.settings.cache.hash) for it in items}
        sizes = {i: await self._num_tokens(k) for i, k in keys.items()}
        segments = plan_chunk([(it.id, it.offset, sizes[it.id]) for it in items], start, end)
        places = mapping = None
        if shm is not None:
            places = shm_mod.placements(segments, start, self._row_bytes, shm.by_position)
            mapping = self.shm.check(shm, max((at + n for at, n in places), default=0))
        t_plan = time.perf_counter()
        try:
            parts = await asyncio.wait_for(
                asyncio.gather(*(self._rows(keys[s.id], s) for s in segments)), timeout_s)
        except BaseException as exc:
            if mapping is not None:
                self.shm.release(mapping)
            if isinstance(exc, TimeoutError):
                raise errors.DeadlineExceeded(f"rows were not ready within timeout_s={timeout_s}") from None
            raise
        t_read = time.perf_counter()
        num_rows = sum(p.shape[0] for p in parts)
        nbytes = num_rows * self._row_bytes
        self.metrics.cache_ms.labels(op="fetch").observe((t_read - t_plan) * 1e3)
        self.metrics.fetch_rows.inc(num_rows)
        self.metrics.fetch_bytes.inc(nbytes)
        timings = {"plan_ms": (t_plan - t0) * 1e3, "read_ms": (t_read - t_plan) * 1e3}
        common = dict(segments=segments, dtype=self.dtype, row_width=self.spec.row_width, layout=self.spec.layout,
                      timings=timings)
        if mapping is not None:  # each segment's rows straight to its place in the file: no concatenation
            if any(p.numel() * p.element_size() != n for (_, n), p in zip(places, parts)):
                self.shm.release(mapping)  # rows of another width or dtype than checked: never write past them
                raise errors.EncoderServiceError("cached rows do not match this model's row size")
            written = await self.shm.write(mapping, shm.offset, [(at, p) for (at, _), p in zip(places, parts)])
            timings["shm_ms"] = (time.perf_counter() - t_read) * 1e3
            return FetchResult(rows=None, shm_bytes=written, **common)
        if len(parts) == 1:  # one image in the chunk: its rows are already one contiguous view, no copy
            rows = parts[0]
        else:
            rows = torch.cat(parts) if parts else torch.empty((0, self.spec.row_width), dtype=self.loaded.dtype)
        return FetchResult(rows=rows.contiguous(), **common)

    def _check_id_count(self, what: str, n: int) -> None:
        limit = self.settings.limits.max_images * 16  # ids of a whole prompt, not of one encode request
        if n > limit:
            raise errors.LimitExceeded(f"number of {what}", n, limit)

    # ---- release ---------------------------------------------------------------------------------------
    def release(self, ids: list[str]) -> int:
        """End the encode pins (leases) of `ids` early: one holder per distinct id, as encode pinned one per
        distinct image. Returns how many ids had a pin to drop; unknown, expired or already released ids count
        0 (not an error); malformed ids are InvalidInput. Entries stay cached (plain LRU entries now)."""
        self._check_id_count("ids to release", len(ids))
        names = {}
        for i in ids:
            try:
                names.setdefault(key_from_id(i, self.model_fp, self.settings.cache.hash).name, i)
            except errors.NotFound as exc:  # key_from_id's "unknown id" is a malformed one here
                raise errors.InvalidInput(exc.message.replace("unknown id", "malformed id", 1)) from None
        return sum(self.store.release(name) for name in names)

    async def _num_tokens(self, key) -> int:
        name = key.name
        if name in self._failures:
            exc = self._failures[name]
            raise type(exc)(f"encode of id {key.id!r} failed: {exc.message}") if type(exc) in _PLAIN else exc
        if name in self._planned:
            return self._planned[name][1]
        header = await self.store.header(key)  # local tier, else only the entry's header from Redis
        if header is None:
            raise errors.NotFound(f"unknown id {key.id!r}: never encoded here, or evicted (encode it again)")
        return header.num_rows

    async def _rows(self, key, seg: Segment) -> torch.Tensor:
        wanted = key.name in self._interest
        if wanted:
            self._want(key.name, +1)
        try:
            rows = await self.store.read_rows(key, seg.row_start, seg.row_end)
        finally:
            if wanted:
                self._want(key.name, -1)
        if rows is None:
            raise errors.NotFound(f"unknown id {key.id!r}: evicted or its encode failed (encode it again)")
        tier = "local" if self.store.peek(key) is not None else "redis"
        self.metrics.cache_hits.labels(tier=tier).inc()
        return rows


# Error types whose constructor takes just a message (LimitExceeded, Overloaded take more).
_PLAIN = (errors.InvalidInput, errors.ImageDecodeError, errors.NotFound, errors.Unavailable,
          errors.DeadlineExceeded, errors.EncoderServiceError)


def _log_fill_failure(task: asyncio.Task) -> None:
    """Background fills nobody awaited still have their failure logged (and retrieved)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, errors.InvalidInput):
        log.warning("encode of %s failed: %s", task.get_name(), exc)


def warmup_image(factor: int) -> bytes:
    """A small RGB PNG (2x2 merged tokens' worth of pixels) for the readiness encode."""
    import io

    from PIL import Image

    side = 2 * factor
    img = Image.new("RGB", (side, side))
    img.putdata([((x * 7) % 256, (y * 13) % 256, ((x + y) * 5) % 256) for y in range(side) for x in range(side)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
