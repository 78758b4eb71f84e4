"""Retries of the clients' calls: what a replica cannot answer now (503 / UNAVAILABLE: Redis away from it,
the service not ready or stopping, a rolling restart) and a server that cannot be reached (connection
refused or reset) are tried again, with exponential backoff and full jitter, inside the caller's deadline.

A server that cannot be reached is said at once: the first refused (or timed out) connect is a WARNING
naming the address, and the tries go on; once a call gets through, the next time it cannot be reached is
said again.

Only calls that may run twice: fetch, release and metadata read; encode too, as an image's id is its
content (or the caller's id for those bytes), so an encode that ran but whose answer was lost names the
same id again (it pins the id once more: the pin ends at release or at its lease). Errors that another try
would only repeat (4xx, 429, 504) are raised at once.

    policy = RetryPolicy(tries=6, first_backoff_s=0.1, max_backoff_s=2.0)
    transport = Retrying(transport, policy)         # AsyncRetrying for the asyncio transports

The transports take the call's timeout as their last argument: the first try gets all of it, each later
try what is left (the server's `timeout_s` shrinks with it), and tries go on until the next pause would
leave less than MIN_TRY_S of that deadline (a Redis outage of a few seconds is ridden out). Without a
timeout, `tries` bounds them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from encoder_service import errors

log = logging.getLogger(__name__)
RETRYABLE = (errors.Unavailable,)  # the server's 503 / UNAVAILABLE, and a server that cannot be reached
# A retry starts only with this much of the caller's timeout left: one started with a sliver of it can only
# time out (a connect not done in the sliver), and the caller would see a timeout (504) where the server
# could not be reached (503).
MIN_TRY_S = 0.2


@dataclass(frozen=True)
class RetryPolicy:
    tries: int = 6  # in all, the first included, for a call without a timeout (1: no retry)
    first_backoff_s: float = 0.1  # the first pause is up to this long; each next one up to twice as long
    max_backoff_s: float = 2.0

    def __post_init__(self):
        if self.tries < 1 or self.first_backoff_s < 0 or self.max_backoff_s < self.first_backoff_s:
            raise ValueError(f"bad retry policy {self}: tries >= 1 and 0 <= first_backoff_s <= max_backoff_s")

    def pauses(self, rng: random.Random) -> Iterator[float]:
        """The pause before each retry, without end: full jitter, uniform in [0, cap), the cap doubling from
        `first_backoff_s` up to `max_backoff_s`, so that clients retrying at once spread out."""
        cap = self.first_backoff_s
        while True:
            yield rng.uniform(0, cap)
            cap = min(self.max_backoff_s, 2 * cap)


DEFAULT_RETRY = RetryPolicy()


class _Attempts:
    """The tries of one call: the timeout left for each, and the pause before the next (None: give up)."""

    def __init__(self, policy: RetryPolicy, timeout: float | None, rng: random.Random):
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._pauses = policy.pauses(rng)
        self._retries_left = policy.tries - 1  # counted only without a deadline

    def left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def pause(self) -> float | None:
        pause = next(self._pauses)
        if self._deadline is None:
            self._retries_left -= 1
            return pause if self._retries_left >= 0 else None
        return pause if time.monotonic() + pause + MIN_TRY_S <= self._deadline else None


class Retrying:
    """A blocking transport (client/http.py, client/grpc_transport.py) whose calls are retried by `policy`."""

    def __init__(self, transport, policy: RetryPolicy = DEFAULT_RETRY, rng: random.Random | None = None):
        self._transport, self._policy, self._rng = transport, policy, rng or random.Random()
        self._unreachable_said = False  # since the last call that got through

    def __getattr__(self, name: str):  # close(), and whatever else a transport has: as it is
        return getattr(self._transport, name)

    def _call(self, fn: Callable, *args, timeout: float | None):
        tries = _Attempts(self._policy, timeout, self._rng)
        while True:
            try:
                return self._got_through(fn(*args, tries.left()))
            except RETRYABLE as exc:
                pause = tries.pause()
                self._say_unreachable(exc, timeout, pause)
                if pause is None:
                    raise
            time.sleep(pause)

    def _got_through(self, result):
        self._unreachable_said = False
        return result

    def _say_unreachable(self, exc: Exception, timeout: float | None, pause: float | None) -> None:
        """The first unreachable try (since a call got through) as a WARNING: a client on a wrong address,
        or a server down, is seen at once, not when the call's timeout ends."""
        if not isinstance(exc, errors.Unreachable) or self._unreachable_said:
            return
        self._unreachable_said = True
        then = "giving up" if pause is None else (f"trying again within the call's timeout ({timeout:g} s)"
                                                  if timeout is not None else "trying again")
        log.warning("%s; %s", exc, then)

    def encode(self, images, wait, return_embeddings, timeout, **ipc):
        encode = functools.partial(self._transport.encode, **ipc) if ipc else self._transport.encode
        return self._call(encode, images, wait, return_embeddings, timeout=timeout)

    def fetch(self, items, start, end, dest, timeout):
        return self._call(self._transport.fetch, items, start, end, dest, timeout=timeout)

    def fetch_shm(self, items, start, end, target, timeout):
        return self._call(self._transport.fetch_shm, items, start, end, target, timeout=timeout)

    def fetch_ipc(self, items, start, end, ipc, timeout):
        return self._call(self._transport.fetch_ipc, items, start, end, ipc, timeout=timeout)

    def release(self, ids, timeout):
        return self._call(self._transport.release, ids, timeout=timeout)

    def metadata(self, timeout):
        return self._call(self._transport.metadata, timeout=timeout)


class AsyncRetrying(Retrying):
    """The same for the asyncio transports: their calls are coroutines, the pauses `asyncio.sleep`."""

    async def _call(self, fn: Callable, *args, timeout: float | None):
        tries = _Attempts(self._policy, timeout, self._rng)
        while True:
            try:
                return self._got_through(await fn(*args, tries.left()))
            except RETRYABLE as exc:
                pause = tries.pause()
                self._say_unreachable(exc, timeout, pause)
                if pause is None:
                    raise
            await asyncio.sleep(pause)
