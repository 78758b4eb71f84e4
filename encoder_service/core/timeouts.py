"""`timeout_s`, as both transports hand it to the core (encode with wait, fetch), and the bounded wait.

  None   no bound
  0      don't wait: answer with what is ready now (cached rows); rows still encoding are the same
         DeadlineExceeded a timeout gives, at once (the core decides what is ready)
  > 0    wait up to that many seconds
Anything else (negative, NaN, infinite, not a number) is InvalidInput.
"""

from __future__ import annotations

import asyncio
import math
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


async def gather_within(timeout_s: float | None, *aws: Awaitable) -> list:
    """`asyncio.gather(*aws)`, TimeoutError past `timeout_s` (None: no bound). The gather runs in a task of
    its own: `asyncio.wait_for` cancelling a bare gather (its caller cancelled: a client went away) leaves
    the gather's CancelledError unretrieved, and asyncio logs that at ERROR when the future is collected."""

    async def gathered() -> list:
        return await asyncio.gather(*aws)

    return await asyncio.wait_for(gathered(), timeout_s)
