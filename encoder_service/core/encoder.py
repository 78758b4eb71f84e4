"""EncoderCore: the one core that HTTP and gRPC adapt (api/http.py, api/grpc_server.py).

encode: images go to image_encode.py, videos to video_encode.py (twins: read, probe, one content per id,
hits, admission and pins all or none, claims in Redis, flights, the answer before the ViT runs; the steps
they share are encode_steps.py). Each id rides one flight (flight.py, the one single flight), whose fill
reads the store and, on a miss, submits the image to the engine (decoded on a CPU thread, encoded on the
GPU thread) and puts its rows in the store, both through the face of the other replicas the core holds
(replicas/face.py: alone, or sharing Redis; the core never asks which). `wait=True` waits for the rows
(and can return them).
fetch: per chunk [start, end), `ranges.plan_chunk` picks the overlapping rows of each image, sized and read
where each id's rows are (id_rows.py: its flight, the store, else the other replicas), only those rows
(waiting for images still encoding). One `timeout_s` covers the waits and the reads (timeouts.Deadline). Where
the rows go is chosen before any wait (fetch_destination.py): the result, the client's shared-memory file
(`ShmTarget`, shm_writer.py), or where they sit on the GPU (IPC: ipc_fetch.py, answered at once when the ids
are not here).
Pins: each id is pinned from its encode until a fetch has delivered every one of its rows (per row, since the
pin began: chunked fetches add up), the caller releases it, or its lease ends; rows stay in the LRU after.
release: drop the encode pins of ids the caller is done with (leases end early).
videos: each frame group is its own flight and entry; fetch and release take frame group ids (`<video
id>#<g>`: `key_of`), and only for those is the video registry asked: a group of a video whose driver has not
reached it yet is sized from the video's plan and waited for (video_flights.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from encoder_service import errors, preprocessing, timeouts
from encoder_service.cache import CacheKey, EmbeddingStore, key_from_id, model_fingerprint
from encoder_service.cache.video_keys import group_key, is_video_id, video_key_from_id
from encoder_service.core import shm_writer
from encoder_service.core.cache_metrics import CacheCollector
from encoder_service.core.fetch_destination import Destinations
from encoder_service.core.flight import Flights
from encoder_service.core.id_rows import IdRows
from encoder_service.core.image_encode import ImageEncoder
from encoder_service.core.ipc_fetch import IpcCollector, IpcFetches
from encoder_service.core.images import ImageReader, Probed, warmup_image, warmup_photo
from encoder_service.core.metrics import Metrics, build_labels
from encoder_service.core.take_over import TakeOver
from encoder_service.core.types import EncodeResult, FetchItem, FetchResult, ImageInfo, ImageInput, VideoInput
from encoder_service.core.urls import UrlFetcher
from encoder_service.core.video_encode import VideoEncoder
from encoder_service.core.video_flights import VideoFlights
from encoder_service.core.videos import ProbedVideo, VideoReader
from encoder_service.engine.engine import Engine, Job
from encoder_service.protocol.dtypes import dtype_name
from encoder_service.protocol.ipc import IpcPlacement, IpcRequest
from encoder_service.protocol.release import InvalidId, Released
from encoder_service.protocol.shm import ShmTarget
from encoder_service.protocol.video_info import VideoInfo
from encoder_service.ranges import Segment, plan_chunk
from encoder_service.replicas import Peers, RedisTier, form
from encoder_service.settings import Settings

log = logging.getLogger(__name__)


class EncoderCore:
    """Built by `build_core(settings)` (api/service.py); `start()` warms up, then `ready()` turns true."""

    def __init__(self, settings: Settings, *, loaded, runner, preprocess_cfg: preprocessing.PreprocessConfig,
                 store: EmbeddingStore, redis: RedisTier | None = None, metrics: Metrics | None = None,
                 ipc_arena=None):
        """`store`: what this process holds; `redis`: the tier replicas share (not started; None: this replica
        is alone); `ipc_arena`: the device row arena (runtime/device_arena.py) for fetches by IPC; None: IPC is
        off."""
        self.settings = settings
        self.loaded, self.runner, self.spec = loaded, runner, loaded.spec
        self.preprocess_cfg = preprocess_cfg
        self.store = store
        self.metrics = metrics or Metrics()
        self.dtype = dtype_name(loaded.dtype)
        lim = settings.limits
        upright = settings.model.exif_orientation
        backend = preprocessing.make_backend(
            settings.model.preprocess, preprocess_cfg,
            preprocessing.ImageLimits(max_image_bytes=lim.max_image_bytes, max_pixels=lim.max_pixels), loaded.device,
            exif_orientation=upright)
        self.model_fp = model_fingerprint(loaded.fingerprint, self.spec.family, self.dtype, preprocess_cfg,
                                          layout=self.spec.layout, preprocess_backend=backend.fingerprint,
                                          exif_orientation=upright)
        self.images = ImageReader(
            backend, UrlFetcher(lim.allow_url_hosts, max_bytes=lim.max_image_bytes), model_fp=self.model_fp,
            hash_algo=settings.cache.hash, dtype=loaded.dtype,
            pin_memory=torch.device(loaded.device).type == "cuda")  # pinned host memory needs CUDA
        self.engine = Engine(encode=runner.encode,
                             batch_tokens=settings.engine.batch_tokens, buckets=runner.buckets,
                             max_queue=settings.engine.max_queue, metrics=self.metrics, arena=ipc_arena)
        # The other replicas, as the core sees them (replicas/face.py): none (Solo) or those sharing `redis`,
        # whose rows of ids they hold come over their row path (replicas/peers.py).
        self.replicas = form(store, redis, Peers(token=settings.server.auth_token, row_width=self.spec.row_width,
                                                 dtype=loaded.dtype, pool=self.engine.host_pool),
                             layout=self.spec.layout, on_unmarked=self.metrics.pending_unmarked.inc)
        self.flights = Flights(self.replicas, self.engine, self.metrics, layout=self.spec.layout,
                               lease_s=settings.cache.lease_s)
        self._row_bytes = self.spec.row_width * loaded.dtype.itemsize
        self.take_over = TakeOver(store, self.replicas, flights=self.flights, images=self.images, engine=self.engine,
                                  row_bytes=self._row_bytes)
        self.image_encoder = ImageEncoder(self.images, self.flights, store, self.engine, self.replicas, self.metrics,
                                          max_images=lim.max_images, max_request_pixels=lim.max_request_pixels,
                                          row_bytes=self._row_bytes, info=self._info)
        self.videos = self._video_encoder(settings, loaded, hash_algo=settings.cache.hash)
        self.id_rows = IdRows(store, self.replicas, self.take_over, self.flights, self.videos.video_flights,
                              self.metrics)
        srv = settings.server
        self.shm = shm_writer.ShmWriter(srv.shm_dir) if srv.shm_fetch else None  # None: shm fetch is off
        self.metrics.registry.register(CacheCollector(self.replicas, self.shm))
        self.ipc = IpcFetches(ipc_arena)  # core/ipc_fetch.py
        self.metrics.registry.register(IpcCollector(self.ipc))
        self.metrics.graph_captures(runner.describe())
        self.destinations = Destinations(self.shm, self.ipc, self.id_rows, self.replicas, dtype=loaded.dtype,
                                         row_bytes=self._row_bytes, max_fetch_bytes=lim.max_fetch_bytes)
        self.metrics.build_info(**build_labels(attention=settings.engine.attention,
                                               preprocess=settings.model.preprocess))
        self._ready = False
        self._draining = False
        self._started = False

    def _video_encoder(self, settings: Settings, loaded, *, hash_algo: str) -> VideoEncoder:
        """The video input path (videos.py, video_flights.py, video_encode.py) on this core's engine, store and
        flights. Videos always go through torch ops on the model's device (never PIL): the device kind is in
        their fingerprint, with the checkpoint's video processor settings and the EXIF setting (frames given as
        images)."""
        cfg = preprocessing.VideoConfig.from_checkpoint(loaded.checkpoint_dir, self.spec)
        v, device = settings.video, torch.device(loaded.device)
        limits = preprocessing.VideoLimits(
            max_bytes=v.max_video_bytes, max_duration_s=v.max_video_duration_s,
            max_source_frames=v.max_video_source_frames, max_frame_pixels=v.max_video_frame_pixels,
            max_decoded_pixels=v.max_video_pixels, max_frames=v.max_video_frames, max_tokens=v.max_video_tokens,
            decoder_threads=v.video_decoder_threads, containers=v.video_containers, codecs=v.video_codecs,
            exif_orientation=settings.model.exif_orientation)
        self.video_fp = model_fingerprint(loaded.fingerprint, self.spec.family, self.dtype, cfg,
                                          layout=self.spec.layout, preprocess_backend=f"video:torch_ops:{device.type}",
                                          exif_orientation=settings.model.exif_orientation)
        urls = UrlFetcher(settings.limits.allow_url_hosts, max_bytes=v.max_video_bytes, what="video")
        reader = VideoReader(cfg, limits, urls, video_fp=self.video_fp, hash_algo=hash_algo, device=device,
                             dtype=loaded.dtype)
        video_flights = VideoFlights(self.flights, self.replicas, reader, window=v.video_window)
        return VideoEncoder(reader, video_flights, self.flights, self.store, self.engine, self.replicas, self.metrics,
                            max_videos=v.max_videos, row_bytes=self._row_bytes, info=self._video_info)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def advertise(self, url: str | None) -> None:
        """Where other replicas fetch the rows this one holds (its HTTP port), before `start`: written in Redis
        beside this replica's liveness (replicas/directory.py); None: they cannot (then they encode an id again
        from its kept bytes, or read a row copy)."""
        self.replicas.advertise(url)

    async def start(self, *, warmup: bool = True) -> None:
        """Start the replicas' face (Redis) and the engine, then run a real tiny encode through the whole
        engine."""
        await self.replicas.start()
        await self.engine.start()
        self._started = True
        if warmup:
            t0 = time.perf_counter()
            image = self.images.probe(0, warmup_image(self.spec.factor), None)
            await self.engine.warm_up(Job(image.data, image.grid_thw, self.images), timeout_s=600)
            log.info("warm-up encode through the engine took %.1f ms", (time.perf_counter() - t0) * 1e3)
            if self.images.backend.device.type == "cuda":
                await self._warm_every_cpu_thread()
        self._ready = True

    async def _warm_every_cpu_thread(self) -> None:
        """Each CPU thread preprocesses on a CUDA stream of its own, and its first large image there allocates
        afresh what later ones reuse: a 1080p photo on every thread, before the first request (none where the
        limits refuse one: each thread then warms on its first image)."""
        try:
            photo = self.images.probe(0, warmup_photo(), None)
        except errors.LimitExceeded as exc:
            log.info("the CPU threads are not warmed with a 1080p photo: %s", exc)
            return
        ms = await self.engine.warm_preparers(Job(photo.data, photo.grid_thw, self.images), timeout_s=600)
        log.info("each CPU thread prepared a 1080p photo: %s ms", " ".join(f"{m:.1f}" for m in ms))

    def drain(self) -> None:
        """Readiness off for good (probes and gRPC Health say NOT_SERVING, so traffic moves elsewhere);
        requests still arriving are served until the transports stop."""
        self._draining = True

    async def stop(self) -> None:
        self._ready = False
        if self._started:
            await self.engine.stop()
        await self.images.urls.close()
        await self.videos.reader.urls.close()
        await self.replicas.close()
        if self.shm is not None:
            await asyncio.to_thread(self.shm.close)  # waits for copies in flight
        self.ipc.close()

    def live(self) -> bool:
        return not self._started or self.engine.alive

    def ready(self) -> bool:
        return self._ready and not self._draining and self.engine.alive

    def readiness(self) -> dict:
        """`ready`, with the Redis tier's state as detail ("up", "down", "failing_over" or "off") and, with
        Redis, `redis_detail`: its kind and each node's state. Redis down leaves the service ready: it serves
        from the local tier and encodes on. Liveness never looks at Redis."""
        return {"ready": self.ready(), **self.replicas.readiness()}

    def metadata(self) -> dict:
        s, spec = self.settings, self.spec
        return {
            "model": s.model.model, "family": spec.family, "model_type": spec.model_type,
            "fingerprint": self.model_fp, "dtype": self.dtype, "device": str(self.loaded.device),
            "row_width": spec.row_width, "hidden_size": spec.out_hidden_size, "num_deepstack": spec.num_deepstack,
            "layout": spec.layout, "patch_size": spec.patch_size, "merge_size": spec.merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "min_pixels": self.preprocess_cfg.min_pixels, "max_pixels": self.preprocess_cfg.max_pixels,
            "preprocess": self.images.backend.fingerprint, "exif_orientation": s.model.exif_orientation,
            "runner": self.runner.describe(), "buckets": list(self.runner.buckets),
            "batch_tokens": s.engine.batch_tokens, "max_queue": s.engine.max_queue,
            "cache": {"local_bytes": s.cache.cache_bytes, "redis": s.cache.redis_url is not None,
                      "hash": s.cache.hash, "lease_s": s.cache.lease_s},
            "limits": {"max_images": s.limits.max_images, "max_body_bytes": s.limits.max_body_bytes,
                       "max_image_bytes": s.limits.max_image_bytes, "max_pixels": s.limits.max_pixels,
                       "max_request_pixels": s.limits.max_request_pixels,
                       "max_fetch_bytes": s.limits.max_fetch_bytes, "url_images": bool(s.limits.allow_url_hosts)},
            "shm_fetch": self.shm is not None,
            "ipc": self.ipc.metadata(),
            "video": self._video_metadata(),
        }

    def _video_metadata(self) -> dict:
        cfg, lim, v = self.videos.reader.cfg, self.videos.reader.limits, self.settings.video
        return {"processor": cfg.processor, "sample_frames": cfg.do_sample_frames, "fps": cfg.fps,
                "min_pixels": cfg.pixels.min_pixels, "max_pixels": cfg.pixels.max_pixels,
                "window": v.video_window, "max_videos": v.max_videos, "max_bytes": lim.max_bytes,
                "max_duration_s": lim.max_duration_s, "max_frames": lim.max_frames,
                "containers": list(lim.containers), "codecs": list(lim.codecs)}

    def _check_serving(self) -> None:
        if not self._ready:
            raise errors.Unavailable("the service is not ready (model loading or warm-up)")
        if not self.engine.alive:
            raise errors.Unavailable("the encode engine is down")

    # ---- encode ----------------------------------------------------------------------------------------
    async def encode(self, images: list[ImageInput], *, wait: bool = False, return_embeddings: bool = False,
                     timeout_s: float | None = None, videos: Sequence[VideoInput] = (),
                     ipc: IpcRequest | None = None) -> EncodeResult:
        """Images, or videos (`videos`: then `images` is empty and the result's `videos` answer, video_encode.py).
        `ipc` (images only; implies `wait`): each image's rows are placed in the device row arena as soon as
        they land, as a fetch by IPC of all of them would place them (core/ipc_fetch.py: a hold, delivered at
        its acknowledgement), the result's `ipc` saying where or why not, per image."""
        t0 = time.perf_counter()
        self._check_serving()
        timeout_s = timeouts.checked(timeout_s)
        if videos:
            if images:
                raise errors.InvalidInput("a request carries images or videos, not both: send them in two requests")
            if ipc is not None:
                raise errors.InvalidInput("an encode answers with rows by IPC for images only: fetch a video's "
                                          "frame groups by IPC")
            return await self.videos.encode(list(videos), wait=wait, return_embeddings=return_embeddings,
                                            timeout_s=timeout_s, t0=t0)
        if ipc is None:
            return await self.image_encoder.encode(images, wait=wait, return_embeddings=return_embeddings,
                                                   timeout_s=timeout_s, t0=t0)
        self.ipc.ack(ipc.ack)  # earlier holds' copies are done
        refused = self.ipc.refusal(ipc)  # off, another host: told now, the encode runs as asked
        result = await self.image_encoder.encode(images, wait=True, return_embeddings=refused is None or
                                                 return_embeddings, timeout_s=timeout_s, t0=t0)
        result.ipc = [refused] * len(images) if refused is not None else self._placed(ipc, result, t0)
        if not return_embeddings:
            result.embeddings = None
        return result

    def _placed(self, ipc: IpcRequest, result: EncodeResult, t0: float) -> list:
        """Where each image's rows (all of them) sit in the arena, held for the consumer (an image twice in the
        request: one placement); delivered to its pin when the hold is acknowledged. A hold's `lease_s` counts
        from the request's receipt (protocol/ipc.py), so the time the encode took is added to it."""
        answers: dict[str, object] = {}
        for info, rows in zip(result.images, result.embeddings):
            if info.id not in answers:
                key, n = self.key_of(info.id), info.num_tokens
                answer = self.ipc.answer(ipc, [rows], lambda key=key, n=n: self.store.delivered(key, n, [(0, n)]))
                if isinstance(answer, IpcPlacement):  # placed now: t0 is no earlier than the receipt
                    answer = dataclasses.replace(answer, lease_s=answer.lease_s + time.perf_counter() - t0)
                answers[info.id] = answer
        return [answers[info.id] for info in result.images]

    def _owner_url(self) -> str | None:
        """Where clients may fetch what this replica answers for directly (with Redis: it holds the rows, or
        pulls them); None without Redis (there is no other replica to go past)."""
        return self.replicas.owner_url

    def _info(self, p: Probed, cached: bool) -> ImageInfo:
        spec = self.spec
        return ImageInfo(id=p.key.id, grid_thw=tuple(p.grid_thw), num_tokens=p.num_tokens,
                         row_width=spec.row_width, hidden_size=spec.out_hidden_size, layout=spec.layout,
                         dtype=self.dtype, cached=cached, owner=self._owner_url())

    def _video_info(self, p: ProbedVideo, cached: bool) -> VideoInfo:
        """The metadata the language model needs: Qwen2/2.5-VL's second_per_grid_t (M-RoPE), Qwen3-VL's group
        timestamps (the prompt's `<t seconds>` text); the other family's is None."""
        spec, plan, qwen3 = self.spec, p.plan, self.videos.reader.cfg.is_qwen3
        return VideoInfo(id=p.key.id, video_grid_thw=tuple(plan.grid_thw), num_tokens=plan.num_tokens,
                         tokens_per_group=plan.tokens_per_group, num_frames=len(plan.frame_indices),
                         sampled_fps=plan.sampled_fps, second_per_grid_t=None if qwen3 else plan.second_per_grid_t,
                         group_timestamps=plan.group_timestamps if qwen3 else None, row_width=spec.row_width,
                         hidden_size=spec.out_hidden_size, layout=spec.layout, dtype=self.dtype, cached=cached,
                         owner=self._owner_url())

    # ---- fetch -----------------------------------------------------------------------------------------
    async def fetch(self, items: list[FetchItem], start: int, end: int, timeout_s: float | None = None,
                    shm: ShmTarget | None = None, ipc: IpcRequest | None = None, peer: str | None = None
                    ) -> FetchResult:
        """The rows of `items` inside [start, end); with `shm`, written into that client file instead (the
        target is checked before any wait for rows) and the result carries `shm_bytes`, no rows; with `ipc`,
        where the rows sit in the device row arena (core/ipc_fetch.py) or why not, no rows (answered before
        any wait, with no segments, when that can be told without the rows). The destination is chosen first
        (core/fetch_destination.py). `peer`: the fetch comes from another replica (replicas/peers.py): answered
        from what is here only (flights, the local tier), never from a third replica; "copy" (that replica
        keeps the rows) ends no pin here, "fetch" (for its client) does, as the client's own fetch would."""
        if peer not in (None, "fetch", "copy"):
            raise errors.InvalidInput(f"peer is {peer!r:.40}, expected \"fetch\" or \"copy\"")
        t0 = time.perf_counter()
        self._check_serving()
        timeout_s = timeouts.checked(timeout_s)
        destination = self.destinations.choose(shm, ipc, peer)
        if not items:
            raise errors.InvalidInput("no items in the fetch")
        self._check_id_count("fetch items", len(items))
        keys = {it.id: self.key_of(it.id) for it in items}
        early = await destination.early(keys)
        if early is not None:  # no rows needed to tell: nothing waited for, read or pulled from elsewhere
            return FetchResult([], None, self.dtype, self.spec.row_width, self.spec.layout,
                               {"plan_ms": (time.perf_counter() - t0) * 1e3}, ipc=early)
        reach = destination.reach
        deadline = timeouts.Deadline(timeout_s)  # one timeout over the sizes (a wait on another replica) and rows
        try:
            sizes = dict(zip(keys, await timeouts.gather_within(
                deadline.bound(), *(self.id_rows.num_tokens(k, deadline, reach) for k in keys.values()))))
        except TimeoutError:
            raise self._rows_late(timeout_s, t0) from None
        segments = plan_chunk([(it.id, it.offset, sizes[it.id]) for it in items], start, end)
        if deadline.dont_wait:  # rows still encoding are not ready (cached ones, here or in Redis, are)
            encoding = sorted({s.id for s in segments if self.id_rows.encoding(keys[s.id])})
            if encoding:
                raise errors.DeadlineExceeded(f"timeout_s=0 (don't wait) and {len(encoding)} of the chunk's images "
                                              f"are still encoding (first: {encoding[0]!r})")
        destination.planned(segments, start)
        t_plan = time.perf_counter()
        try:
            parts = await timeouts.gather_within(
                deadline.bound(), *(self.id_rows.rows(keys[s.id], s, reach) for s in segments))
        except BaseException as exc:
            destination.abort()
            if isinstance(exc, TimeoutError):
                raise self._rows_late(timeout_s, t0) from None
            raise
        t_read = time.perf_counter()
        num_rows = sum(p.shape[0] for p in parts)
        self.metrics.cache_latency.observe(t_read - t_plan, op="fetch")
        self.metrics.fetch_rows.inc(num_rows)
        self.metrics.fetch_bytes.inc(num_rows * self._row_bytes)
        timings = {"plan_ms": (t_plan - t0) * 1e3, "read_ms": (t_read - t_plan) * 1e3}
        result = FetchResult(segments, None, self.dtype, self.spec.row_width, self.spec.layout, timings)
        return await destination.finish(parts, result, lambda: self._delivered(keys, segments, sizes))

    def _delivered(self, keys: dict[str, CacheKey], segments: list[Segment], sizes: dict[str, int]) -> None:
        """The fetch has every segment's rows: per id, the rows it delivered (an id placed twice in the prompt
        counts once) go to the store, where a pin whose every row was delivered since it began loses a holder
        (cache/local.py: delivered). A client that fetches all rows and never releases holds its pins only
        until then. A fetch another replica serves from here for its client counts here."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for s in segments:
            ranges.setdefault(s.id, []).append((s.row_start, s.row_end))
        for public_id, delivered in ranges.items():
            self.store.delivered(keys[public_id], sizes[public_id], delivered)

    def _check_id_count(self, what: str, n: int) -> None:
        limit = self.settings.limits.max_images * 16  # ids of a whole prompt, not of one encode request
        if n > limit:
            raise errors.LimitExceeded(f"number of {what}", n, limit)

    @staticmethod
    def _rows_late(timeout_s: float | None, t0: float) -> errors.DeadlineExceeded:
        return errors.DeadlineExceeded(f"rows were not ready within timeout_s={timeout_s} "
                                       f"(waited {time.perf_counter() - t0:.3f}s)")

    # ---- release ---------------------------------------------------------------------------------------
    def release(self, ids: list[str]) -> Released:
        """End the encode pins (leases) of `ids` early: one holder per distinct id, as encode pinned one per
        distinct image. Answers how many ids had a pin to drop; unknown, expired or already released ids count
        0 (not an error); malformed ones are answered as invalid, with why, and the others released all the
        same. Entries stay cached (plain LRU entries now)."""
        self._check_id_count("ids to release", len(ids))
        names, invalid = set(), {}
        for public_id in ids:
            try:
                names.add(self._release_names(public_id))  # a video id: the key names of its frame groups
            except errors.InvalidInput as exc:
                invalid.setdefault(public_id, InvalidId.of(public_id, exc.message))
        return Released(sum(any([self.store.release(name) for name in group]) for group in names),
                        tuple(invalid.values()))

    def key_of(self, public_id: str) -> CacheKey:
        """The key of an id a client sent back: an image's, or a video's frame group's (a video id alone is
        InvalidInput here: fetch names its groups, <id>#<g>)."""
        if not is_video_id(public_id):
            return key_from_id(public_id, self.model_fp, self.settings.cache.hash)
        video, group = video_key_from_id(public_id, self.video_fp, self.settings.cache.hash)
        if group is None:
            raise errors.InvalidInput(f"{public_id!r:.80} is a video: fetch names its frame groups, "
                                      f"{public_id:.80}#<group> (0-based)")
        return group_key(video, group)

    def _release_names(self, public_id: str) -> tuple[str, ...]:
        """Key names whose pins a release of `public_id` drops: a video id's are those of every frame group a
        video may have (--max-video-frames / 2: a pin lookup each), a group id's its own."""
        if not is_video_id(public_id):
            return (key_from_id(public_id, self.model_fp, self.settings.cache.hash).name,)
        video, group = video_key_from_id(public_id, self.video_fp, self.settings.cache.hash)
        groups = range(-(-self.settings.video.max_video_frames // self.spec.temporal_patch_size))
        return tuple(group_key(video, g).name for g in (groups if group is None else [group]))
