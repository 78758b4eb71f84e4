"""The one way tests wait for a state that another thread, task or process changes (a server's loop, a
background probe, a child process): a bounded poll of a predicate. On timeout it raises an AssertionError
naming what it waited for and for how long, so a hang is a failure that says what never happened.

A predicate may also return True early on a state that makes the wait pointless (a call that ended): the
caller then asserts what it needs. A test that only shows that something did NOT happen has nothing to wait
for: it waits for an event that proves the other side is in place, or sleeps with a comment saying why long
enough."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WAIT_S = 20.0  # long enough for two shared, loaded CPU cores; a state reached sooner ends the wait sooner
POLL_S = 0.01


def _timed_out(what: str | Callable[[], str], timeout_s: float) -> AssertionError:
    return AssertionError(f"waited {timeout_s:g}s for {what() if callable(what) else what}")


def wait_for(predicate: Callable[[], object], what: str | Callable[[], str], timeout_s: float = WAIT_S,
             poll_s: float = POLL_S) -> None:
    """Returns once `predicate()` is true; after `timeout_s`, AssertionError naming `what` (a callable: made at
    the failure, e.g. with a log tail). The predicate runs on this thread: it may raise to end the wait."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s)
        time.sleep(poll_s)


async def async_wait_for(predicate: Callable[[], object], what: str | Callable[[], str],
                         timeout_s: float = WAIT_S, poll_s: float = POLL_S) -> None:
    """wait_for on an event loop: sleeps with asyncio, so the tasks it waits on run meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s)
        await asyncio.sleep(poll_s)
