"""Stopping background tasks (replicas/background.py): a shutdown ends even when a task loses a cancellation."""

import asyncio

from encoder_service.replicas import background


async def _loses_one_cancellation(stopped: asyncio.Event) -> None:
    """A loop whose first cancellation is lost (as one inside a Redis round trip can be), which then runs on."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()
    try:
        while True:
            await asyncio.sleep(0.01)
    finally:
        stopped.set()


async def test_a_task_that_loses_its_cancellation_is_cancelled_again():
    stopped = asyncio.Event()
    plain = asyncio.create_task(asyncio.sleep(3600))
    lossy = asyncio.create_task(_loses_one_cancellation(stopped))
    await asyncio.sleep(0)
    await asyncio.wait_for(background.stop([plain, lossy]), 5.0)  # one cancel() each: this waited forever
    assert plain.cancelled() and lossy.cancelled() and stopped.is_set()


async def test_a_task_that_never_stops_is_left_after_the_grace(caplog):
    released = asyncio.Event()

    async def stubborn():
        while not released.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    await asyncio.wait_for(background.stop([task], grace_s=0.2), 5.0)
    assert not task.done() and "stubborn" in caplog.text
    released.set()
    await task
