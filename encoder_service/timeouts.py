"""`timeout_s`, as both transports hand it to the core (encode with wait, fetch), and the bounded waits.

  None   no bound
  0      don't wait: answer with what is ready now (cached rows); rows still encoding are the same
         DeadlineExceeded a timeout gives, at once (the core decides what is ready)
  > 0    wait up to that many seconds
Anything else (negative, NaN, infinite, not a number) is InvalidInput.

`Deadline`: one `timeout_s` over several waits in turn (a fetch waits for another replica's encode, then
reads the rows): each wait gets what is left of it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable

from encoder_service import errors


def checked(timeout_s) -> float | None:
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s < 0:
        raise errors.InvalidInput(f"timeout_s must be a finite number of seconds >= 0 (0: don't wait), "
                                  f"got {timeout_s!r}")
    return float(timeout_s)


class Deadline:
    """A checked `timeout_s` started now."""

    def __init__(self, timeout_s: float | None, clock=time.monotonic):
        self.timeout_s = timeout_s
        self._clock = clock
        self._at = None if timeout_s is None else clock() + timeout_s

    @property
    def dont_wait(self) -> bool:
        return self.timeout_s == 0

    def left(self) -> float | None:
        """`timeout_s` semantics for the next wait: None (no bound), else the seconds left, 0 once past (then
        a wait answers with the state now, as for timeout_s=0)."""
        return None if self._at is None else max(0.0, self._at - self._clock())

    def bound(self) -> float | None:
        """The bound for `gather_within`: None without a timeout and for "don't wait" (the core answers at once
        what is not ready: nothing to time), else the seconds left."""
        return None if self.dont_wait else self.left()


async def gather_within(timeout_s: float | None, *aws: Awaitable) -> list:
    """`asyncio.gather(*aws)`, TimeoutError past `timeout_s` (None: no bound). The first failure cancels the
    others (a fetch answering 404 for one id stops waiting for the rest). One awaitable is awaited in the
    caller's task, and the bound is `asyncio.timeout` (no task of its own): a fetch whose rows are ready
    then costs the event loop no task switch (each is a pass of the loop: a measurable share of a small
    fetch's time)."""
    async with asyncio.timeout(timeout_s):
        if len(aws) == 1:
            return [await aws[0]]
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # no-op for the finished ones
