"""In-flight ids: one `Flight` per id this core is encoding, and what is remembered of failed ones.

A flight starts with the first encode request of an id that has it neither cached nor in flight, and ends
when its fill does (the entry is in the store, or the encode failed). It holds everything the core needs
about the id meanwhile:

  grid_thw, num_tokens  what encode answered: a fetch sizes the id's segments from them before the rows exist
  waiters               encode requests that want the rows (those not waiting for them: until the lease
                        ends; a waiting one that is cancelled leaves) and fetches reading them; the engine
                        asks `wanted()` before it batches the image and drops it at 0
  permit                the engine queue room admitted for the image (engine.py: admit): used when the fill
                        submits it; released when the flight ends without (a Redis hit, or a fill of the
                        store's already in flight)
  task                  the fill: the store's single flight (cache/store.py: get_or_create), whose create
                        encodes the image; -> (Entry, created: whether this flight ran the encode)

Requests for an id in flight join its flight (one more waiter, no queue room); a failure is remembered
for the id (bounded, oldest dropped) so that a fetch after a failed encode gets the failure, not a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from encoder_service import errors
from encoder_service.cache import CacheKey, Entry
from encoder_service.engine.engine import Permit

log = logging.getLogger(__name__)

FAILURES_KEPT = 4096


@dataclass(eq=False)
class Flight:
    key: CacheKey
    grid_thw: tuple[int, int, int]
    num_tokens: int
    permit: Permit | None  # None: nothing admitted (a cached id: its flight ends at once)
    waiters: int = 1
    task: asyncio.Task | None = None

    def wanted(self) -> bool:
        return self.waiters > 0


Fill = Callable[[Flight], Awaitable[tuple[Entry, bool]]]


class Flights:
    """The flights of one core, by cache key name. Event loop only."""

    def __init__(self, failures_kept: int = FAILURES_KEPT):
        self._flights: dict[str, Flight] = {}
        self._failures: OrderedDict[str, errors.EncoderServiceError] = OrderedDict()
        self._failures_kept = failures_kept

    def __contains__(self, name: str) -> bool:
        return name in self._flights

    def get(self, name: str) -> Flight | None:
        return self._flights.get(name)

    def join(self, key: CacheKey, grid_thw: tuple[int, int, int], num_tokens: int, permit: Permit | None,
             fill: Fill) -> Flight:
        """`key`'s flight, with one more waiter. Not in flight: a new flight (with `permit`, admitted for it)
        whose task runs `fill(flight)`. Either way the id's remembered failure is forgotten."""
        self._failures.pop(key.name, None)
        flight = self._flights.get(key.name)
        if flight is not None:
            flight.waiters += 1
            return flight
        flight = self._flights[key.name] = Flight(key, grid_thw, num_tokens, permit)
        flight.task = asyncio.create_task(self._fly(flight, fill), name=f"encode {key.id}")
        flight.task.add_done_callback(_log_failure)
        return flight

    async def _fly(self, flight: Flight, fill: Fill) -> tuple[Entry, bool]:
        name = flight.key.name
        try:
            return await fill(flight)
        except errors.EncoderServiceError as exc:
            self._failures[name] = exc
            while len(self._failures) > self._failures_kept:
                self._failures.popitem(last=False)
            raise
        finally:
            if flight.permit is not None:
                flight.permit.release()  # never submitted (or used up already: release is idempotent)
            if self._flights.get(name) is flight:
                del self._flights[name]

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
                flight.waiters -= 1


def _log_failure(task: asyncio.Task) -> None:
    """Fills nobody awaited still have their failure logged (and retrieved)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, errors.InvalidInput):
        log.warning("encode of %s failed: %s", task.get_name(), exc)
