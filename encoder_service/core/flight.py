"""In-flight ids, the one single flight: one `Flight` per id this core is filling, and what is remembered of
failed ones.

A flight starts with the first encode request of an id that has no flight here (or, with Redis, with a
fetch of an id whose accepting replica is gone: core/take_over.py), and ends when its fill does. The fill
only calls down, with data, through the face of the replicas (replicas/face.py):

    replicas.get(key)                   this process's store, else Redis (a row copy another replica wrote)
    replicas.pull(key)                  else the rows from the replica holding them (peer to peer)
    while another replica claimed the image (Redis; replicas/directory.py):
         replicas.wait_for(key)         its rows land (read them), or it is gone: replicas.mark_pending
                                        claims the image here (whoever claims first encodes it)
    else engine.submit([Job(image bytes, grid_thw)])  -> rows   (decoded on a CPU thread, ViT on the GPU)
         replicas.put(key, entry)       the store, and written behind to Redis
    on any failure (cancelled too): replicas.failed(key, exc): Redis publishes it (or releases the claim)

and resolves to `Landed(entry, encoded, timings)`. A flight holds everything the core needs about its id
meanwhile:

  grid_thw, num_tokens  what encode answered: a fetch sizes the id's segments from them before the rows exist
  content_tag           of the bytes under a caller id (0 for a content key): the same id with other bytes
                        is a Conflict, not a join; rows found in the store with another tag too
  waiters               encode requests that want the rows (those not waiting for them: until the lease
                        ends; a waiting one that is cancelled leaves) and fetches reading them
  permit                the engine queue room admitted for the image (engine.py: admit): used when the fill
                        submits it (kept while it waits for another replica: it may encode the image after
                        all); released when the flight ends without (the store had the rows)
  task                  the fill -> Landed

Requests for an id in flight join its flight (one more waiter, no queue room) and `leave()` it when they go
before its end. The last to leave (every caller left: a waiting encode or fetch whose client disconnected)
ends the flight at once: its fill is cancelled, which takes the image out of the engine queue (its queue
slot and prepared pixels return then, not when the next batch is built) and publishes the drop; a new
request for the id starts a new flight. A failure of the image's own (it does not decode, another replica's
verdict on it) is remembered for the id (bounded, oldest dropped) so that a fetch after a failed encode
gets the failure, not a 404; a timeout or an unavailable engine or peer is not (NOT_THE_IMAGES).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from encoder_service import errors
from encoder_service.cache import CacheKey, Entry, other_content
from encoder_service.cache.video_keys import VIDEO_PREFIX
from encoder_service.core.images import Probed
from encoder_service.core.metrics import Metrics
from encoder_service.engine.engine import Engine, Job, Permit
from encoder_service.replicas import Marked, Replicas, Settled

log = logging.getLogger(__name__)

FAILURES_KEPT = 4096
# Failures of the moment or of this replica (a timeout, an engine or peer unavailable, a full queue), not of
# the image: never remembered as its outcome, so a later fetch looks again (another replica, a take-over).
NOT_THE_IMAGES = frozenset({"deadline", "unavailable", "overloaded"})


@dataclass(frozen=True)
class Landed:
    """What a flight's fill resolves to."""

    entry: Entry
    encoded: bool  # this flight ran the encode (False: the store had the rows)
    timings: dict[str, float] = field(default_factory=dict)  # the engine's (ms) when encoded


@dataclass(eq=False)
class Flight:
    key: CacheKey
    grid_thw: tuple[int, int, int]
    num_tokens: int
    content_tag: int  # cache/keys.py: content_tag (0: a content key, which is its content)
    permit: Permit | None  # None: nothing admitted (a cached id: its fill finds the entry at once)
    waiters: int = 1
    task: asyncio.Task | None = None
    urgent: bool = False  # a fetch waits for it: queued ahead of other work (a video's frame group)

    def wanted(self) -> bool:
        return self.waiters > 0

    def abandoned(self) -> bool:
        return not self.wanted() and self.task is not None and not self.task.done()


class Flights:
    """The flights of one core, by cache key name. Event loop only. Fills read and write through `replicas`
    and encode on `engine`; `layout` is the rows' (models/spec.py), `lease_s` how long an encode stays wanted
    (past it nobody holds the id)."""

    def __init__(self, replicas: Replicas, engine: Engine, metrics: Metrics, *, layout: str, lease_s: float,
                 failures_kept: int = FAILURES_KEPT):
        self._replicas, self._engine, self._metrics = replicas, engine, metrics
        self._layout, self._lease_s = layout, lease_s
        self._flights: dict[str, Flight] = {}
        self._failures: OrderedDict[str, errors.EncoderServiceError] = OrderedDict()
        self._failures_kept = failures_kept

    def __contains__(self, name: str) -> bool:
        return name in self._flights

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, name: str) -> Flight | None:
        return self._flights.get(name)

    def join(self, image: Probed, permit: Permit | None, *, after: asyncio.Future[Marked | None] | None = None
             ) -> Flight:
        """The flight of `image`'s id, with one more waiter. Not in flight: a new flight (with `permit`,
        admitted for it) whose fill starts once `after` is done (the id's claim being written: the fill's
        outcome settles it, so it must not be published first; an id another replica claimed first is not
        encoded here unless that replica goes away). Either way the id's remembered failure is forgotten."""
        key = image.key
        self._failures.pop(key.name, None)
        flight = self._flights.get(key.name)
        if flight is not None:
            flight.waiters += 1
            return flight
        flight = self._flights[key.name] = Flight(key, image.grid_thw, image.num_tokens, image.content_tag, permit)
        flight.task = asyncio.create_task(self._fly(flight, image, after), name=f"encode {key.id}")
        flight.task.add_done_callback(_log_failure)
        return flight

    def leave(self, flight: Flight) -> None:
        """A waiter goes before the flight ends (its request was cancelled). The last one ends the flight:
        nobody wants its rows, so its work is dropped now (the fill is cancelled: out of the engine queue, or
        no longer waiting on another replica) and a later request starts a new flight."""
        flight.waiters -= 1
        if flight.abandoned():
            if self._flights.get(flight.key.name) is flight:
                del self._flights[flight.key.name]
            flight.task.cancel()

    async def _fly(self, flight: Flight, image: Probed, after: asyncio.Future[Marked | None] | None) -> Landed:
        name = flight.key.name
        try:
            marked = await asyncio.shield(after) if after is not None else None
            return await self._fill(flight, image, elsewhere=marked is not None and name in marked.elsewhere)
        except errors.Conflict:  # the request's failure (its bytes are not what the id names), never the id's
            raise
        except BaseException as exc:  # cancelled too (every caller left): Redis publishes it, if claimed here
            if after is not None and not after.done():  # once the claim is written, not before
                after.add_done_callback(lambda _, exc=exc: self._replicas.failed(flight.key, exc))
            else:
                self._replicas.failed(flight.key, exc)
            if isinstance(exc, errors.EncoderServiceError) and exc.kind not in NOT_THE_IMAGES:
                self._failures[name] = exc
                while len(self._failures) > self._failures_kept:
                    self._failures.popitem(last=False)
            raise
        finally:
            if flight.permit is not None:
                flight.permit.release()  # never submitted (or used up already: release is idempotent)
            if self._flights.get(name) is flight:
                del self._flights[name]

    async def _fill(self, flight: Flight, image: Probed, *, elsewhere: bool) -> Landed:
        deadline = time.monotonic() + self._lease_s
        while True:
            entry = await self._replicas.get(flight.key)
            pulled = entry is None and (entry := await self._replicas.pull(flight.key)) is not None
            if entry is not None:
                if other_content(flight.content_tag, entry.header.content_tag):  # another replica's rows
                    await self._replicas.withdraw(flight.key, entry.header.content_tag)
                    raise conflict(flight.key)
                if pulled:  # a copy here: its location names this replica too, and that settles our claim
                    self._replicas.put(flight.key, entry)
                if flight.permit is not None:  # a local miss when admitted: another replica's rows
                    self._metrics.cache_hits.labels(tier="peer" if pulled else "redis").inc()
                return Landed(entry, encoded=False)
            if not elsewhere:
                break
            elsewhere = await self._wait_elsewhere(flight, image.data, deadline)
        self._metrics.cache_misses.inc()
        (item,) = self._engine.submit([Job(image.data, flight.grid_thw, image.reader, wanted=flight.wanted,
                                           urgent=flight.urgent, requester=image.requester)],
                                      deadline=deadline, permits=None if flight.permit is None else [flight.permit])
        encoded = await item.future  # cancelled with the fill when every waiter leaves: the engine drops it
        # The engine's rows are owned host tensors: the entry takes them without a copy.
        entry = Entry.from_rows(encoded.rows, encoded.grid_thw, self._layout, copy=False,
                                content_tag=flight.content_tag)
        self._replicas.put(flight.key, entry)
        return Landed(entry, encoded=True, timings=encoded.timings)

    async def _wait_elsewhere(self, flight: Flight, data: Any, deadline: float) -> bool:
        """Another replica claimed the image first: wait for its rows rather than encode them twice. Its
        failure is this flight's (raised). Once its claim is settled (the rows landed: the fill reads them next,
        should their replica still give them), gone (ORPHANED), or Redis cannot tell (down) or lost it, claim
        the image here: False when this replica got it (read the rows, else encode it here), True when another
        one did first (wait for that one). Never encode without the claim: two replicas that outlived the
        replica holding the rows would both encode it again."""
        key = flight.key
        settled = await self._replicas.wait_for(key, max(0.0, deadline - time.monotonic()))
        if settled is Settled.TIMED_OUT:
            raise errors.DeadlineExceeded(f"id {key.id!r}: the replica encoding it did not finish within the "
                                          f"lease ({self._lease_s:g} s)")
        kept = {key.name: data} if isinstance(data, bytes) else {}  # a video's frame group keeps no bytes
        marked = await self._replicas.mark_pending([key], self._lease_s, {key.name: flight.content_tag}, kept)
        return key.name in marked.elsewhere

    def raise_failure(self, key: CacheKey) -> None:
        """Raise how the id's last encode failed, if it did (and no encode of it started since)."""
        exc = self._failures.get(key.name)
        if exc is None:
            return
        raise exc.prefixed(f"encode of id {key.id!r} failed: ")

    @contextlib.contextmanager
    def waiting(self, name: str) -> Iterator[Flight | None]:
        """A fetch waiting for an id's rows: its flight (None: not in flight), which stays wanted meanwhile."""
        flight = self._flights.get(name)
        if flight is not None:
            flight.waiters += 1
        try:
            yield flight
        finally:
            if flight is not None:
                self.leave(flight)


def conflict(key: CacheKey) -> errors.Conflict:
    what = "video" if key.id.startswith(VIDEO_PREFIX) else "image"
    return errors.Conflict(f"id {key.id!r} already names other {what} bytes (an id names one {what}: send these "
                           "under another id)")


def _log_failure(task: asyncio.Task) -> None:
    """Fills nobody awaited still have their failure logged (and retrieved)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, (errors.InvalidInput, errors.Conflict)):  # the request's fault
        log.warning("encode of %s failed: %s", task.get_name(), exc)
