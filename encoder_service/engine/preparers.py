"""The CPU threads that prepare the engine's jobs (decode, resize, patchify: `Job.reader.prepare`), shared
fairly between requests.

Each requester's jobs (one encode request's images, one video's frame groups) wait behind its own earlier
ones, and the threads take from the requesters in turn (round robin: one served goes to the back of the line,
behind those that came meanwhile): a request of sixteen large images holds another request's small image back
by the prepares running when it comes and one of each requester ahead of it, not by all sixteen, as a first
come, first served queue of images did. Urgent jobs (a fetch waits for them) are taken before any other.

    preparers = Preparers(prepare, threads, start_thread)   # prepare(job) -> result, on a CPU thread
    prepared = preparers.submit(job, requester)             # an asyncio future of the result, on this loop
    prepared.cancel()                                       # not started yet: it leaves the queue
    warmed = preparers.on_every_thread(job)                 # one future per thread: `job` prepared on each
    preparers.stop()

A result (or the exception `prepare` raised) is handed to its future on the loop; a job whose future is
cancelled before a thread starts it is never run, and a future cancelled while its job runs gets nothing.
Thread-safe: `submit` and cancellation on the loop, `_take` on the threads, under one lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any


class _Task:
    __slots__ = ("job", "requester", "future", "loop")

    def __init__(self, job: Any, requester: Hashable, future: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.job, self.requester, self.future, self.loop = job, requester, future, loop


class Preparers:
    """`prepare(job)` on `threads` threads, each started by `start_thread(name, target)` (the engine's: a
    thread whose death is noticed)."""

    def __init__(self, prepare: Callable[[Any], Any], threads: int,
                 start_thread: Callable[[str, Callable[[], None]], threading.Thread]):
        self._prepare = prepare
        self._ready = threading.Condition()
        # Requesters with jobs waiting, in the order the threads serve them: the first is served next, then goes
        # to the back of the line (or leaves it, with no job left).
        self._line: OrderedDict[Hashable, deque[_Task]] = OrderedDict()
        self._urgent: deque[_Task] = deque()
        self._own: list[deque[_Task]] = [deque() for _ in range(threads)]  # each thread's, before any other job
        self._stopped = False
        self.threads = [start_thread(f"encoder-prepare-{k}", lambda k=k: self._run(k)) for k in range(threads)]

    def submit(self, job: Any, requester: Hashable, *, urgent: bool = False) -> asyncio.Future:
        """Queue `job` for `requester`; its future, on the running loop."""
        loop = asyncio.get_running_loop()
        task = _Task(job, requester, loop.create_future(), loop)
        with self._ready:
            if urgent:
                self._urgent.append(task)
            else:
                self._line.setdefault(task.requester, deque()).append(task)
            self._ready.notify()
        task.future.add_done_callback(lambda future: self._forget(task) if future.cancelled() else None)
        return task.future

    def on_every_thread(self, job: Any) -> list[asyncio.Future]:
        """`job` prepared once by each thread, ahead of any job not yet taken (the start-up warm-up: each
        thread's own CUDA stream and the memory its work takes there); one future per thread, on the running
        loop. A future cancelled before its thread takes it is skipped (it stays in that thread's queue until
        then)."""
        loop = asyncio.get_running_loop()
        tasks = [_Task(job, None, loop.create_future(), loop) for _ in self._own]
        with self._ready:
            for own, task in zip(self._own, tasks):
                own.append(task)
            self._ready.notify_all()
        return [task.future for task in tasks]

    def stop(self) -> None:
        """The threads end after the job each is running (the queued ones are never run: their futures are the
        engine's to settle)."""
        with self._ready:
            self._stopped = True
            self._ready.notify_all()

    def _forget(self, task: _Task) -> None:
        """A cancelled job leaves the queue (if no thread took it yet)."""
        with self._ready:
            if task in self._urgent:
                self._urgent.remove(task)
                return
            tasks = self._line.get(task.requester)
            if tasks is not None and task in tasks:
                tasks.remove(task)
                if not tasks:
                    del self._line[task.requester]

    def _take(self, thread: int) -> _Task | None:
        """Thread number `thread`'s next job (None: stopped), waiting for one."""
        with self._ready:
            while not self._stopped:
                if self._own[thread]:
                    return self._own[thread].popleft()
                if self._urgent:
                    return self._urgent.popleft()
                if self._line:
                    requester, tasks = next(iter(self._line.items()))
                    task = tasks.popleft()
                    del self._line[requester]
                    if tasks:  # to the back of the line: the others' next jobs go first
                        self._line[requester] = tasks
                    return task
                self._ready.wait()
            return None

    def _run(self, thread: int) -> None:
        while (task := self._take(thread)) is not None:
            # Cancelled after it was queued, and taken before _forget ran (a done callback runs on the loop,
            # later): nobody wants its result.
            if task.future.cancelled():
                continue
            try:
                outcome = (self._prepare(task.job), None)
            except Exception as exc:  # the job's failure (a corrupt image), answered to its future
                outcome = (None, exc)
            try:
                task.loop.call_soon_threadsafe(_settle, task.future, outcome)
            except RuntimeError:  # the loop is closed: nobody waits for it
                pass


def _settle(future: asyncio.Future, outcome: tuple[Any, BaseException | None]) -> None:
    if future.done():  # cancelled while it ran
        return
    result, exc = outcome
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
