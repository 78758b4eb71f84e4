"""An encode of images (EncoderCore.encode), step for step; video_encode.py is its twin for videos, and the
steps both share are encode_steps.py:

  read, probe    images.py: the bytes (inline or an allow-listed URL), then on CPU threads the cache key and
                 the size from the header alone
  ids            unique_items, check_contents: a caller id sent with other bytes than it names (here, or
                 bound in Redis by any replica) is a Conflict (409), before anything is admitted
  hits           each id in the local tier (store.peek) is cached: its entry's grid and size answer for it
  admit          ids neither cached nor in flight get engine queue room, all or none (429 when full); every
                 id is pinned for its lease (pin_all: 429 when the pins are full, 400 when they never could be)
  mark           with Redis the admitted images are claimed there, their bytes beside the claims, and the
                 hits shared (directory.py), before the answer
  join           flight.py: each id joins its flight or starts one (a miss with its permit)
  answer         ImageInfo per image (protocol/image_info.py), before the ViT runs; `wait` waits for the rows,
                 `return_embeddings` returns them
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from encoder_service import errors
from encoder_service.cache import EmbeddingStore, Entry
from encoder_service.core.encode_steps import check_contents, pin_all, unique_items, wait_all
from encoder_service.core.flight import Flight, Flights
from encoder_service.core.images import ImageReader, Probed
from encoder_service.core.metrics import Metrics
from encoder_service.core.types import EncodeResult, ImageInfo, ImageInput
from encoder_service.engine.engine import Engine, Permit
from encoder_service.replicas import Replicas


class ImageEncoder:
    """`info(probed, cached) -> ImageInfo` fills in the model's fields (row width, layout, dtype)."""

    def __init__(self, reader: ImageReader, flights: Flights, store: EmbeddingStore, engine: Engine,
                 replicas: Replicas, metrics: Metrics, *, max_images: int, max_request_pixels: int, row_bytes: int,
                 info: Callable[[Probed, bool], ImageInfo]):
        self.reader, self.flights, self.store, self.engine = reader, flights, store, engine
        self.replicas, self.metrics = replicas, metrics
        self.max_images, self.max_request_pixels = max_images, max_request_pixels
        self._row_bytes, self._info = row_bytes, info

    async def encode(self, images: list[ImageInput], *, wait: bool, return_embeddings: bool,
                     timeout_s: float | None, t0: float) -> EncodeResult:
        n = len(images)
        if n == 0:
            raise errors.InvalidInput("no images in the request")
        if n > self.max_images:
            raise errors.LimitExceeded("number of images in the request", n, self.max_images)
        wait = wait or return_embeddings
        datas = await asyncio.gather(*(self.reader.read(i, img) for i, img in enumerate(images)))
        t_read = time.perf_counter()
        loop = asyncio.get_running_loop()
        requester = object()  # this request: the engine prepares its images in order, other requests' in turn
        probed: list[Probed] = await asyncio.gather(*(
            loop.run_in_executor(self.engine.cpu_pool, self.reader.probe, i, data, img.caller_id, requester)
            for i, (data, img) in enumerate(zip(datas, images))))
        t_probe = time.perf_counter()
        timings = {"read_ms": (t_read - t0) * 1e3, "decode_ms": (t_probe - t_read) * 1e3}
        pixels = sum(p.pixels for p in probed)  # what decoding them costs, cached or not: known before any is
        if pixels > self.max_request_pixels:
            raise errors.LimitExceeded(f"decoded pixel count of the request's {n} images together", pixels,
                                       f"{self.max_request_pixels} (--max-request-pixels)",
                                       "send them in several requests")

        unique, first_index = unique_items(probed, "image")
        await check_contents(self.replicas, {name: (p.key, p.key, p.content_tag) for name, p in unique.items()
                                            if p.content_tag}, self._local_tags, first_index, "image")
        hits = {name: self.store.peek(name) for name in unique}
        for name, entry in hits.items():  # what the id names (an entry from before content tags: unchecked)
            if entry is not None:
                unique[name] = dataclasses.replace(unique[name], grid_thw=entry.header.grid_thw,
                                                   num_tokens=entry.num_rows)
        permits = self._admit_and_pin(unique, hits, first_index)
        self.metrics.cache_hits.labels(tier="local").inc(sum(e is not None for e in hits.values()))
        marking = self.replicas.mark([unique[name] for name in permits],  # None without Redis
                                    [unique[name].key for name, entry in hits.items() if entry is not None])

        # Every id joins its flight (or starts one: a miss with its permit, a cached id to read its entry).
        # Nothing is awaited between the admission and the joins: a concurrent request for the same id must
        # find the flight (or it would be admitted a second time).
        flights = {name: self.flights.join(p, permits.get(name), after=marking if name in permits else None)
                   for name, p in unique.items()}
        if marking is not None:
            try:  # before answering: once the caller has the ids, a fetch elsewhere must find them pending
                await asyncio.shield(marking)
            except asyncio.CancelledError:
                self._leave(flights)
                raise
        infos = [self._info(unique[p.key.name], hits[p.key.name] is not None) for p in probed]
        result = EncodeResult(images=infos, timings=timings)
        if wait:
            not_cached = sum(entry is None for entry in hits.values())
            if timeout_s == 0 and not_cached:
                raise errors.DeadlineExceeded(f"timeout_s=0 (don't wait) and {not_cached} of the request's images "
                                              "are not cached yet (their encode goes on)")
            # timeout_s=0 here: every id is a local hit, pinned above, so its flight ends without waiting.
            done = await wait_all({name: f.task for name, f in flights.items()}, timeout_s or None, t0,
                                  first_index, "image", lambda: self._leave(flights))
            # Cached for this request unless its own miss started the flight that ran the encode.
            ran = {name for name in permits if done[name].encoded}
            for name in ran:  # the engine's timings of the images this request had encoded
                timings.update({k: v for k, v in done[name].timings.items() if k.endswith("_ms")})
            result.images = [dataclasses.replace(i, cached=i.cached or p.key.name not in ran)
                             for i, p in zip(infos, probed)]
            if return_embeddings:
                result.embeddings = [done[p.key.name].entry.tensor for p in probed]
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        return result

    def _local_tags(self, name: str) -> tuple[int, int]:
        """The content tags the id's entry and flight here carry (0: none)."""
        entry, flight = self.store.peek(name), self.flights.get(name)
        return (entry.header.content_tag if entry is not None else 0,
                flight.content_tag if flight is not None else 0)

    def _admit_and_pin(self, unique: dict[str, Probed], hits: dict[str, Entry | None],
                       first_index: dict[str, int]) -> dict[str, Permit]:
        """Queue room for the ids neither cached nor in flight (their permits, by name), and a pin on every
        id for its lease (what it counts: the entry's size, or the rows' still to come); all or none."""
        misses = [name for name, entry in hits.items() if entry is None and name not in self.flights]
        permits = dict(zip(misses, self.engine.admit(len(misses))))

        def undo() -> None:
            for permit in permits.values():
                permit.release()

        pin_all(self.store, self.engine,
                {name: [(p.key, hits[name].nbytes if hits[name] is not None else p.num_tokens * self._row_bytes)]
                 for name, p in unique.items()}, first_index, "image", undo,
                hint_one="this image can never be pinned here: send it smaller, or raise --max-pinned-bytes")
        return permits

    def _leave(self, flights: dict[str, Flight]) -> None:
        """The caller left before its answer: its images are not wanted by it any more, nor pinned for it."""
        for name, flight in flights.items():
            self.flights.leave(flight)
            self.store.unpin(name)
