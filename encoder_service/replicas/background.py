"""Stopping the replicas' background tasks (the announcer, the tier's writer and heartbeat, the pub/sub reader).

One `cancel()` is not always enough: a cancellation can be lost inside a Redis round trip (seen in the tests: the
announcer's TOUCH pipeline, cancelled as a Redis restart closed its connection, returned normally), and the
loop then runs on, so that a shutdown awaiting it hangs. `stop` cancels again until each task is done, within
`grace_s`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

_RECANCEL_S = 0.05  # how often a task that swallowed its cancellation is cancelled again


async def stop(tasks: Iterable[asyncio.Future], grace_s: float = 10.0) -> None:
    """Cancel `tasks` and wait until they are done (what they raised is retrieved and dropped), cancelling
    again any that swallowed it; those still running after `grace_s` are left (logged), so that a shutdown
    ends."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    deadline = asyncio.get_running_loop().time() + grace_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            log.warning("%d background tasks still running after %.3g s of cancelling them: %s", len(pending),
                        grace_s, ", ".join(t.get_name() if isinstance(t, asyncio.Task) else repr(t) for t in pending))
            break
        _, pending = await asyncio.wait(pending, timeout=min(_RECANCEL_S, left))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "Task exception was never retrieved" at its collection
