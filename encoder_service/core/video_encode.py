"""An encode of videos (EncoderCore.encode with `videos`), step for step as an encode of images
(image_encode.py; the steps both share are encode_steps.py), with a video's frame groups where an image's one
entry is:

  read, probe        videos.py: the bytes, then on CPU threads the header (limits), the plan and the key
  ids                a caller id sent with another video (bytes or sampling) than it names: Conflict (409),
                     checked on its frame group 0 (here: its entry, its video's or group's flight; Redis: the
                     id's binding, first come first served), before anything is admitted
  hits               each group in the local tier (store.peek) is cached; the rest are the video's todo (a
                     flight of the video here that will not encode all of them is waited out first)
  admit              a video with groups to encode and not in flight here reserves engine room for its window
                     (engine.py: Reservation), all or none over the request's videos (429 when the queue is
                     full); every group is pinned for its lease (its bytes, or its rows still to come: 429 when
                     the pins are full, 400 when they never could be)
  mark               with Redis the groups to encode are marked pending (a fetch elsewhere waits for them) and
                     the hits shared, before the answer
  join               video_flights.py: the video's flight (its driver encodes the todo groups in order)
  answer             VideoInfo per video (protocol/video_info.py), before the ViT runs; `wait` waits for
                     every group, `return_embeddings` returns the video's rows, its groups' one after the other
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import torch

from encoder_service import errors
from encoder_service.cache import EmbeddingStore, Entry
from encoder_service.cache.video_keys import GROUP_SEP
from encoder_service.core.encode_steps import check_contents, pin_all, unique_items, wait_all
from encoder_service.core.flight import Flights
from encoder_service.core.metrics import Metrics
from encoder_service.core.types import EncodeResult, VideoInput
from encoder_service.core.video_flights import VideoFlight, VideoFlights
from encoder_service.core.videos import ProbedVideo, VideoReader
from encoder_service.engine.engine import Engine, Reservation
from encoder_service.protocol.video_info import VideoInfo
from encoder_service.replicas import GroupClaim, Replicas

REJOINS = 3  # lookups of a request whose groups a flight in progress will not encode (each waits that flight out)


class VideoEncoder:
    """`info(probed, cached) -> VideoInfo` fills in the model's fields (row width, layout, dtype)."""

    def __init__(self, reader: VideoReader, video_flights: VideoFlights, flights: Flights, store: EmbeddingStore,
                 engine: Engine, replicas: Replicas, metrics: Metrics, *, max_videos: int, row_bytes: int,
                 info: Callable[[ProbedVideo, bool], VideoInfo]):
        self.reader, self.video_flights, self.flights = reader, video_flights, flights
        self.store, self.engine, self.replicas, self.metrics = store, engine, replicas, metrics
        self.max_videos, self._row_bytes, self._info = max_videos, row_bytes, info

    async def encode(self, videos: list[VideoInput], *, wait: bool, return_embeddings: bool,
                     timeout_s: float | None, t0: float) -> EncodeResult:
        n = len(videos)
        if n > self.max_videos:
            raise errors.LimitExceeded("number of videos in the request", n, self.max_videos)
        wait = wait or return_embeddings
        datas = await asyncio.gather(*(self.reader.read(i, v) for i, v in enumerate(videos)))
        t_read = time.perf_counter()
        loop = asyncio.get_running_loop()
        probed: list[ProbedVideo] = await asyncio.gather(*(
            loop.run_in_executor(self.engine.cpu_pool, self.reader.probe, i, data, v)
            for i, (data, v) in enumerate(zip(datas, videos))))
        t_probe = time.perf_counter()
        timings = {"read_ms": (t_read - t0) * 1e3, "decode_ms": (t_probe - t_read) * 1e3}

        unique, first_index = unique_items(probed, "video")
        # A video's groups all carry its content tag: its group 0's binding answers for it.
        await check_contents(self.replicas, {name: (p.key, p.group_keys()[0], p.content_tag)
                                            for name, p in unique.items() if p.content_tag},
                             self._local_tags, first_index, "video")
        hits, todo = await self._lookup(unique, timeout_s, t0)
        reservations = self._admit_and_pin(unique, hits, todo, first_index)
        self.metrics.cache_hits.labels(tier="local").inc(sum(e is not None for h in hits.values() for e in h))
        marking = self.replicas.mark(
            [GroupClaim(unique[name].group_keys()[g], unique[name].content_tag) for name in reservations
             for g in todo[name]],
            [k for name, p in unique.items() for k, e in zip(p.group_keys(), hits[name]) if e is not None])
        # Nothing is awaited between the admission and the joins (a concurrent request must find the flight).
        joined = {name: self.video_flights.join(p, todo[name], reservations.get(name), after=marking)
                  for name, p in unique.items() if name in reservations or name in self.video_flights}
        if marking is not None:
            try:  # before answering: once the caller has the ids, a fetch elsewhere must find them pending
                await asyncio.shield(marking)
            except asyncio.CancelledError:
                self._leave(unique, joined)
                raise
        infos = [self._info(p, not todo[p.key.name]) for p in probed]
        result = EncodeResult(images=[], videos=infos, timings=timings)
        if wait:
            if timeout_s == 0 and joined:
                raise errors.DeadlineExceeded(f"timeout_s=0 (don't wait) and {len(joined)} of the request's videos "
                                              "are not cached yet (their encode goes on)")
            await wait_all({name: vf.task for name, vf in joined.items()}, timeout_s or None, t0, first_index,
                           "video", lambda: self._leave(unique, joined))
            result.videos = [dataclasses.replace(i, cached=i.cached or p.key.name not in reservations)
                             for i, p in zip(infos, probed)]
            if return_embeddings:
                rows = {name: self._rows(hits[name], joined.get(name)) for name in unique}
                result.embeddings = [rows[p.key.name] for p in probed]
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        return result

    async def _lookup(self, unique: dict[str, ProbedVideo], timeout_s: float | None, t0: float
                      ) -> tuple[dict[str, list[Entry | None]], dict[str, tuple[int, ...]]]:
        """(each video's groups in the local tier, None where missing; the missing groups: its todo). A video in
        flight here that will not encode a group this request misses (it was cached when that flight started
        and evicted since) is waited for, then looked up again: a request joins a flight only for groups the
        flight encodes."""
        for _ in range(REJOINS):
            hits = {name: [self.store.peek(k) for k in p.group_keys()] for name, p in unique.items()}
            todo = {name: tuple(g for g, entry in enumerate(hits[name]) if entry is None) for name in unique}
            behind = [vf.task for name in unique if (vf := self.video_flights.get(name)) is not None
                      and not set(todo[name]) <= set(vf.todo)]
            if not behind:
                return hits, todo
            left = None if not timeout_s else max(0.0, timeout_s - (time.perf_counter() - t0))
            _, pending = await asyncio.wait(behind, timeout=left)  # never cancels them: others wait too
            if pending:
                raise errors.DeadlineExceeded(f"encode did not finish within timeout_s={timeout_s} (an encode of "
                                              "the same video was still running)")
        raise errors.Overloaded("the request's videos lost frame groups to eviction while they were being "
                                "encoded, again and again: the cache is too small for them")

    def _local_tags(self, name: str) -> tuple[int, int, int]:
        """The content tags the video's group 0 entry and flight, and its video flight, here carry (0: none)."""
        vf, group0 = self.video_flights.get(name), f"{name}{GROUP_SEP}0"
        entry, flight = self.store.peek(group0), self.flights.get(group0)
        return (entry.header.content_tag if entry is not None else 0,
                flight.content_tag if flight is not None else 0, vf.video.content_tag if vf is not None else 0)

    def _admit_and_pin(self, unique: dict[str, ProbedVideo], hits: dict[str, list[Entry | None]],
                       todo: dict[str, tuple[int, ...]], first_index: dict[str, int]) -> dict[str, Reservation]:
        """Engine room for the videos with groups to encode that are not in flight here (a reservation of their
        window each, by name), and a pin on every group for its lease (its entry's size, or its rows' still to
        come); all or none."""
        window = self.video_flights.window
        reservations: dict[str, Reservation] = {}

        def undo() -> None:
            for reservation in reservations.values():
                reservation.close()

        try:
            for name in unique:
                if todo[name] and name not in self.video_flights:
                    reservations[name] = self.engine.reserve(min(window, len(todo[name])))
        except errors.Overloaded:
            undo()
            raise
        pin_all(self.store, self.engine,
                {name: [(k, e.nbytes if e is not None else p.plan.tokens_per_group * self._row_bytes)
                        for k, e in zip(p.group_keys(), hits[name])] for name, p in unique.items()},
                first_index, "video", undo,
                hint_one="this video can never be pinned here: sample fewer frames (fps, num_frames), lower "
                         "max_pixels, or raise --max-pinned-bytes")
        return reservations

    def _leave(self, unique: dict[str, ProbedVideo], joined: dict[str, VideoFlight]) -> None:
        """The caller left before its answer: its videos are not wanted by it any more, nor pinned for it."""
        for vf in joined.values():
            self.video_flights.leave(vf)
        for p in unique.values():
            for k in p.group_keys():
                self.store.unpin(k)

    def _rows(self, hits: list[Entry | None], vf: VideoFlight | None) -> torch.Tensor:
        """The video's rows [num_tokens, row_width]: its groups' entries one after the other."""
        entries = [e if e is not None else vf.landed[g] for g, e in enumerate(hits)]
        return torch.cat([e.tensor for e in entries])
