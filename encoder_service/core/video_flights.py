"""Videos in flight: one `VideoFlight` per video this core is encoding, whose driver feeds its frame groups to
the engine in order, a window at a time, each group its own flight (flight.py) and its own cache entry.

    driver: for each group g not cached when the video's encode started, in order:
              wait until fewer than `window` of the video's groups are in the engine (or a group lands)
              flights.join(group g: Job(GroupJob(decoder, g), (1, h, w)), a permit of the video's reservation)
                 -> replicas.get, else the engine (the CPU threads decode group g from the video's one
                    decoder, in order, and prepare it; the GPU thread encodes it batched with other work),
                    replicas.put
            a group that fails ends the video: the groups after it fail with its error

So a video never has more than `window` groups queued or prepared (the engine's Reservation holds that room
from the encode on, whatever else is admitted), nor more than one group's frames decoding at a time; the
first groups are encoded first, and a chunked prefill can fetch them while the rest is still encoding. A
fetch of a group not started yet waits for the driver to reach it, and the groups the driver submits while
a fetch waits go to the front of the engine queue (`demand`).

A video flight holds, meanwhile:
  video        the probed video (key, plan, bytes) and its decoder
  todo         the groups to encode (those not cached when it started)
  waiters      encode requests that want it (as a Flight's); at 0 the driver stops and leaves its groups'
               flights, so the engine drops what it has not batched
  started      per group of todo: a future set once its flight is joined (a fetch of it waits on this)
  landed       the entries of the groups that landed, for `wait` / `return_embeddings`
  task         the driver: ends once every group landed, or raises the first failure
A failure is remembered for the video (bounded, oldest dropped), so that a fetch of any of its groups gets it,
not a 404.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass, field

from encoder_service import errors
from encoder_service.cache import CacheKey, Entry
from encoder_service.cache.video_keys import GROUP_SEP
from encoder_service.core.flight import FAILURES_KEPT, Flight, Flights
from encoder_service.core.images import Probed
from encoder_service.core.videos import GroupJob, ProbedVideo, VideoDecoder, VideoReader
from encoder_service.engine.engine import Reservation
from encoder_service.replicas import Replicas

log = logging.getLogger(__name__)


@dataclass(eq=False)
class VideoFlight:
    video: ProbedVideo
    todo: tuple[int, ...]
    reservation: Reservation
    decoder: VideoDecoder
    waiters: int = 1
    demand: int = -1  # the highest group a fetch waits for
    started: dict[int, asyncio.Future] = field(default_factory=dict)
    flights: dict[int, Flight] = field(default_factory=dict)  # the groups' flights, as the driver joins them
    landed: dict[int, Entry] = field(default_factory=dict)
    task: asyncio.Task | None = None
    let_go: bool = False  # the driver's waiter left its groups' flights (nobody drives them now)

    @property
    def key(self) -> CacheKey:
        return self.video.key

    def wanted(self) -> bool:
        return self.waiters > 0


def split_group(key: CacheKey) -> tuple[str, int] | None:
    """(video key name, group) of a frame group's key; None for any other key."""
    video, sep, group = key.name.rpartition(GROUP_SEP)
    return (video, int(group)) if sep and group.isdigit() else None


class VideoFlights:
    """The video flights of one core, by the video's key name. Event loop only. Groups fly as `flights`
    (the core's, shared with images); `window`: a video's groups in the engine at once."""

    def __init__(self, flights: Flights, replicas: Replicas, reader: VideoReader, *, window: int,
                 failures_kept: int = FAILURES_KEPT):
        self._flights, self._replicas, self._reader, self.window = flights, replicas, reader, window
        self._videos: dict[str, VideoFlight] = {}
        self._failures: OrderedDict[str, errors.EncoderServiceError] = OrderedDict()
        self._failures_kept = failures_kept

    def __contains__(self, name: str) -> bool:
        return name in self._videos

    def get(self, name: str) -> VideoFlight | None:
        return self._videos.get(name)

    def join(self, video: ProbedVideo, todo: tuple[int, ...], reservation: Reservation | None, *,
             after: Awaitable | None = None) -> VideoFlight:
        """The video's flight with one more waiter, or a new one (with `reservation`, made for it: None only
        joins one in flight) that encodes the groups `todo` once `after` is done (their pending markers
        written). Forgets a remembered failure."""
        name = video.key.name
        self._failures.pop(name, None)
        vf = self._videos.get(name)
        if vf is not None:
            vf.waiters += 1
            if reservation is not None:
                reservation.close()
            return vf
        if reservation is None:
            raise RuntimeError(f"video {video.key.id} is not in flight: a new flight needs its engine reservation")
        decoder = VideoDecoder(video.video, video.plan, self._reader.limits, todo=todo, keep=self.window)
        vf = self._videos[name] = VideoFlight(video, todo, reservation, decoder)
        loop = asyncio.get_running_loop()
        vf.started = {g: loop.create_future() for g in todo}
        vf.task = asyncio.create_task(self._drive(vf, after), name=f"encode video {video.key.id}")
        vf.task.add_done_callback(_retrieve)
        return vf

    def leave(self, vf: VideoFlight) -> None:
        """A waiter goes before the video landed (its request was cancelled): at 0 the driver stops and its
        groups' flights lose their driver's waiter (the engine drops what it has not batched)."""
        vf.waiters -= 1
        if not vf.wanted():
            self._let_go(vf)

    def _let_go(self, vf: VideoFlight) -> None:
        """The driver's waiter leaves the groups' flights still in the engine (once)."""
        if not vf.let_go:
            vf.let_go = True
            for flight in vf.flights.values():
                if not flight.task.done():
                    self._flights.leave(flight)

    # ---- the driver ----------------------------------------------------------------------------------
    async def _drive(self, vf: VideoFlight, after: Awaitable | None) -> None:
        name, plan = vf.key.name, vf.video.plan
        keys = vf.video.group_keys()
        active: dict[asyncio.Task, int] = {}
        try:
            if after is not None:
                await asyncio.shield(after)
            for g in vf.todo:
                while len(active) >= self.window:
                    await self._landed(vf, active, asyncio.FIRST_COMPLETED)
                if not vf.wanted():
                    raise asyncio.CancelledError
                group = Probed(keys[g], plan.group_grid, plan.tokens_per_group, GroupJob(vf.decoder, plan, g),
                               vf.video.content_tag, self._reader, requester=vf)  # prepared in order
                flight = vf.flights[g] = self._flights.join(group, vf.reservation.permit())
                flight.urgent = g <= vf.demand
                vf.started[g].set_result(None)
                active[flight.task] = g
            while active:
                await self._landed(vf, active, asyncio.ALL_COMPLETED)
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, errors.EncoderServiceError):
                failure = exc
            elif isinstance(exc, asyncio.CancelledError):
                failure = errors.Unavailable("the video's encode was dropped (every request that wanted it left)")
            else:  # a bug, not the video's fault: the traceback in the log
                log.exception("encode of video %s failed", vf.key.id)
                failure = errors.EncoderServiceError("internal error")
            self._fail(vf, failure, keys)
            raise failure from None
        finally:
            vf.reservation.close()
            vf.decoder.close()
            if self._videos.get(name) is vf:
                del self._videos[name]

    async def _landed(self, vf: VideoFlight, active: dict[asyncio.Task, int], when: str) -> None:
        """Wait for the first (or every) active group to land; a failed one raises its error, naming it."""
        done, _ = await asyncio.wait(active, return_when=when)
        for task in done:
            g = active.pop(task)
            if task.cancelled():
                raise asyncio.CancelledError
            exc = task.exception()
            if exc is not None:
                if isinstance(exc, errors.EncoderServiceError):
                    raise exc.prefixed(f"frame group {g}: ")
                raise exc
            vf.landed[g] = task.result().entry

    def _fail(self, vf: VideoFlight, exc: errors.EncoderServiceError, keys: list[CacheKey]) -> None:
        """The video failed or was dropped: remembered for fetches; its groups not started fail, in Redis too
        (their pending markers), and the fetches waiting for them hear it."""
        self._failures[vf.key.name] = exc
        while len(self._failures) > self._failures_kept:
            self._failures.popitem(last=False)
        self._let_go(vf)
        for g, started in vf.started.items():
            if not started.done():
                self._replicas.failed(keys[g], exc)
                started.set_exception(exc)
                started.exception()  # retrieved: nobody may be waiting

    # ---- fetch ---------------------------------------------------------------------------------------
    def group_tokens(self, key: CacheKey) -> int | None:
        """Rows of frame group `key` of a video in flight here, or its video's remembered failure (raised);
        None for any other key (then the group's own flight, entry or handoff answers)."""
        parts = split_group(key)
        if parts is None:
            return None
        self.raise_failure(key)
        vf = self._videos.get(parts[0])
        if vf is None or parts[1] >= vf.video.plan.num_groups:
            return None
        return vf.video.plan.tokens_per_group

    async def started(self, key: CacheKey) -> None:
        """Once frame group `key`'s flight is joined, if its video is in flight here and the group is still to
        come: the driver submits it (and those before it) to the front of the engine queue meanwhile."""
        parts = split_group(key)
        vf = self._videos.get(parts[0]) if parts is not None else None
        if vf is None or parts[1] not in vf.started:
            return
        g = parts[1]
        if not vf.started[g].done():
            vf.demand = max(vf.demand, g)
            await asyncio.shield(vf.started[g])

    def encoding(self, key: CacheKey) -> bool:
        """Whether frame group `key` belongs to a video in flight here whose driver has not reached it."""
        parts = split_group(key)
        vf = self._videos.get(parts[0]) if parts is not None else None
        return vf is not None and parts[1] in vf.started and not vf.started[parts[1]].done()

    def raise_failure(self, key: CacheKey) -> None:
        """Raise how the encode of frame group `key`'s video failed, if it did (and did not start again)."""
        parts = split_group(key)
        exc = self._failures.get(parts[0]) if parts is not None else None
        if exc is not None:
            raise exc.prefixed(f"encode of id {key.id!r} failed: ")


def _retrieve(task: asyncio.Task) -> None:
    """Drivers nobody awaited still have their failure logged (and retrieved)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, (errors.InvalidInput, errors.Conflict, errors.Unavailable)):
        log.warning("encode of %s failed: %s", task.get_name(), exc)
