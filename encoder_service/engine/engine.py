"""The encode engine: CPU threads prepare images, ONE thread owns the GPU.

    submit() --(CPU threads: decode/resize/patchify)--> Scheduler --(batcher task)--> to_gpu --> GPU thread
                                                                                      (<= 1 waiting batch)
    GPU thread: launch the batch, queue its device-to-host copy (runtime/transfer.py) --> in flight
                (<= 1 waiting) --> completion thread: wait for the copy, answer the futures

The CPU threads (preparers.py) take jobs from the requests in turn, each request's in its order, so one
request of many large images does not hold up everyone else's. The batcher (a task on the event loop) waits
until the GPU thread has taken the previous batch, then packs the next one from whatever is queued and
prepared (waiting for the first prepare to end when none has), so batches grow while the GPU is busy, the
CPU work of the next batch overlaps the ViT of the current one, and no batch waits for an image still being
prepared. The GPU thread never waits for the GPU: it launches the next batch while the completion thread
waits for the previous one's rows, so the GPU runs batches back to back (at most three batches are launched
and unanswered at a time). Answers go through futures via
`loop.call_soon_threadsafe`; the threads never touch the loop otherwise. A batch that raises fails only its
own items; if a thread itself dies, the engine turns not-alive and every waiting caller gets Unavailable.

The engine is built with its GPU stage, `encode`; each `Job` names its CPU stage, the `reader` whose
`prepare` turns the job's data (what to prepare, and the grid its pixel values must have) into pixel
values on a CPU thread: an image's bytes (core/images.py: ImageReader), a video's frame group
(core/videos.py: VideoReader). A job is data, never a closure.

Admission is checked once, in `admit(n)`: room for n images in the queue (at most max_queue, counting the
permits handed out and not used yet), all or none, else Overloaded (HTTP 429). A caller that admits early
(the core, before it answers encode) submits later with those permits; `submit` without permits admits
its jobs itself. The Retry-After hint (`retry_after_s`) is the backlog of the slower stage: the CPU
threads' (images admitted whose prepare has not finished) or the GPU's (patches queued).

A caller that submits a long run of items over time (a video's frame groups, core/video_flights.py) takes a
`Reservation` instead: room for `size` items, checked once like `admit`, held until it is closed; the items
it submits (each with one of its permits) count against it, not again against the queue, so the caller
keeps at most `size` of them in the engine at once whatever is admitted meanwhile. An `urgent` job (one a
fetch waits for) goes to the front of the queue, and is prepared first.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch

from encoder_service.engine.preparers import Preparers
from encoder_service.engine.scheduler import GridTHW, Scheduler, WorkItem, always_wanted, batch_budget, drop
from encoder_service.errors import Overloaded, Unavailable
from encoder_service.runtime.transfer import HostCopier

log = logging.getLogger(__name__)

# (pixel_values list, grid_thw list) -> one [num_tokens_i, row_width] tensor per image (TowerRunner.encode)
EncodeFn = Callable[[Sequence[torch.Tensor], Sequence[GridTHW]], list[torch.Tensor]]


@dataclass(frozen=True)
class EncodedImage:
    rows: torch.Tensor  # [num_tokens, row_width], CPU, contiguous, owned (nothing else refers to it)
    grid_thw: GridTHW
    timings: dict[str, float]  # preprocess_ms, queue_ms, encode_ms (whole batch), batch_images


class Reader(Protocol):
    def prepare(self, data: Any, grid_thw: GridTHW) -> torch.Tensor:
        """On a CPU thread: pixel values [t*h*w, patch_dim] of `data`, ready for `encode`."""


@dataclass(frozen=True)
class Job:
    """One unit of ViT work: `data` is what `reader.prepare` takes (an image's encoded bytes, a video's frame
    group; the engine never looks inside), `grid_thw` the grid its pixel values must have (t*h*w patches).
    Dropped from the queue once `wanted()` is false."""

    data: Any
    grid_thw: GridTHW
    reader: Reader
    wanted: Callable[[], bool] = always_wanted
    urgent: bool = False  # queued and prepared ahead of everything else (a fetch waits for it)
    # Who asked (an encode request, a video; None: the `submit` call): the CPU threads take from the
    # requesters in turn, each one's jobs in their order (preparers.py), and batch them in that order.
    requester: Hashable | None = None


class Permit:
    """Room for one image in the encode queue, from `Engine.admit`: counted in the queue's occupancy until
    `submit` uses it (the queued image counts itself then) or `release()` gives it back (idempotent). A
    reservation's permit (`Reservation.permit()`) counts nothing itself: its reservation holds the room."""

    def __init__(self, engine: Engine, reservation: Reservation | None = None):
        self._engine: Engine | None = engine
        self.reservation = reservation

    def release(self) -> None:
        if self._engine is not None:
            if self.reservation is None:
                self._engine._permits -= 1
            self._engine = None


class Reservation:
    """Room for `size` items in the encode queue from `Engine.reserve`, counted in the queue's occupancy until
    `close()` (idempotent). Items submitted with its permits count against it while queued, not again; the
    holder keeps at most `size` of them in the engine at once."""

    def __init__(self, engine: Engine, size: int):
        self._engine: Engine | None = engine
        self.size = size

    def permit(self) -> Permit:
        if self._engine is None:
            raise RuntimeError("the reservation is closed")
        return Permit(self._engine, self)

    def close(self) -> None:
        if self._engine is not None:
            self._engine._permits -= self.size
            self._engine = None


class Engine:
    def __init__(self, *, encode: EncodeFn, batch_tokens: int, buckets: Sequence[int] = (),
                 max_queue: int = 256, cpu_threads: int | None = None, metrics=None, arena=None):
        """`arena`: the device row arena (runtime/device_arena.py) the rows also go into, for fetches by IPC."""
        self._encode = encode
        self._scheduler = Scheduler(batch_budget(batch_tokens, buckets))
        self.max_queue = max_queue
        self._permits = 0  # admitted images not submitted yet (Permits not used or released), and reservations
        self._cpu_threads = cpu_threads or min(8, os.cpu_count() or 2)
        # The callers' header reads and hashing (core/images.py: probe); prepares run on the engine's own
        # threads (self._preparers), so a request's probe never waits behind other requests' decodes.
        self.cpu_pool = ThreadPoolExecutor(max_workers=self._cpu_threads, thread_name_prefix="encoder-cpu")
        self._preparers: Preparers | None = None
        self._preparing = 0  # submitted images whose prepare (decode, resize, patchify) has not finished
        self._prepare_s: float | None = None  # moving average of one prepare on a CPU thread, for Retry-After
        self._metrics = metrics
        self._copier = HostCopier(arena=arena)
        self._to_gpu: queue.Queue = queue.Queue()
        self._in_flight: queue.Queue = queue.Queue(maxsize=1)  # launched batches waiting for their rows
        self._on_gpu: set[WorkItem] = set()  # handed to the GPU thread, not answered yet (loop-side view)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slot: asyncio.Semaphore | None = None
        self._wakeup: asyncio.Event | None = None
        self._threads: list[threading.Thread] = []
        self._batcher: asyncio.Task | None = None
        self._death: BaseException | None = None
        self._stopping = False
        self._batch_s = 0.05  # moving average of one batch's GPU time, for Retry-After
        self._last_done = 0.0  # when the previous batch's rows arrived (time.monotonic())

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._slot = asyncio.Semaphore(1)
        self._wakeup = asyncio.Event()
        self._threads = [self._start_thread("encoder-gpu", self._gpu_loop),
                         self._start_thread("encoder-complete", self._complete_loop)]
        self._preparers = Preparers(_timed, self._cpu_threads, self._start_thread)
        self._batcher = asyncio.create_task(self._batch_loop(), name="encoder-batcher")
        self._batcher.add_done_callback(self._batcher_done)

    async def stop(self) -> None:
        """Fail what is queued, let the GPU thread finish its batch, join it."""
        self._stopping = True
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
        self._fail_all(Unavailable("the service is shutting down"))
        if self._preparers is not None:
            self._preparers.stop()  # each ends after its prepare (not joined: a decode may take a while)
        if any(t.is_alive() for t in self._threads):
            self._to_gpu.put(None)  # the GPU thread passes it on to the completion thread
            for thread in self._threads:
                await asyncio.to_thread(thread.join)
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
        # Its idle mappings go, and its prefault thread ends; rows still held by entries keep their mappings.
        await asyncio.to_thread(self._copier.pool.close)

    @property
    def host_pool(self):
        """Where the rows of encoded images live on the host (rowpath/host_pool.py: HostRowPool); other rows
        that become cache entries (pulled from another replica) take their memory from it too."""
        return self._copier.pool

    @property
    def alive(self) -> bool:
        threads = self._threads + (self._preparers.threads if self._preparers is not None else [])
        return (self._death is None and not self._stopping and bool(self._threads)
                and all(t.is_alive() for t in threads) and self._batcher is not None and not self._batcher.done())

    @property
    def queue_depth(self) -> int:
        """Images queued for a batch (the encoder_queue_depth gauge)."""
        return len(self._scheduler)

    @property
    def permits(self) -> int:
        """Images admitted and not submitted yet, plus the room reservations hold."""
        return self._permits

    # ---- admission and submission (event loop) ---------------------------------------------------------
    def admit(self, n: int) -> list[Permit]:
        """Room for `n` images, all or none: Overloaded (with a Retry-After hint) when the images queued plus
        the permits outstanding plus `n` would exceed max_queue."""
        self._check_room(n)
        self._permits += n
        return [Permit(self) for _ in range(n)]

    def reserve(self, size: int) -> Reservation:
        """Room for `size` items held until the reservation is closed (checked as `admit(size)` is)."""
        self._check_room(size)
        self._permits += size
        return Reservation(self, size)

    def _check_room(self, n: int) -> None:
        # Queued items under a reservation are counted by it (in _permits), not again.
        waiting = len(self._scheduler) - self._scheduler.reserved + self._permits
        if n and waiting + n > self.max_queue:
            raise Overloaded(f"encode queue is full: {waiting} images waiting, max_queue is {self.max_queue}, "
                             f"this request adds {n}", retry_after_s=self.retry_after_s())

    def submit(self, jobs: Sequence[Job], *, deadline: float | None = None,
               permits: Sequence[Permit] | None = None, warmup: bool = False) -> list[WorkItem]:
        """Queue one request's images (placeholder order). `deadline`: time.monotonic() seconds. `permits`:
        one per job from `admit` (used up here, whatever happens); without them the jobs are admitted here.

        Raises Unavailable when the engine is down, Overloaded when admitting here finds the queue full. Each
        item's `future` resolves to an EncodedImage or raises; it is cancelled when the job's `wanted()` turns
        false while it waits; cancelling it takes the item out of the queue at once. `warmup`: the readiness
        encode, left out of the metrics.
        """
        try:
            if not self.alive:
                raise Unavailable(self._down_reason())
            if permits is None:
                permits = self.admit(len(jobs))
            loop = self._loop
            items = []
            call = object()  # the requester of jobs that name none: this call
            for job in jobs:
                requester = call if job.requester is None else job.requester
                prepared = self._preparers.submit(job, requester, urgent=job.urgent)
                self._preparing += 1
                prepared.add_done_callback(self._prepared)
                items.append(WorkItem(grid_thw=job.grid_thw, prepared=prepared, future=loop.create_future(),
                                      deadline=deadline, wanted=job.wanted, warmup=warmup, urgent=job.urgent,
                                      requester=requester))
                items[-1].future.add_done_callback(functools.partial(self._cancelled, items[-1]))
            for item, permit in zip(items, permits):
                item.reserved = permit.reservation is not None
            self._scheduler.push(items)
        finally:
            for permit in permits or ():  # the queued items count themselves now
                permit.release()
        self._gauge()
        self._wakeup.set()
        return items

    def _cancelled(self, item: WorkItem, future: asyncio.Future) -> None:
        """An item whose future was cancelled (its caller gave it up) leaves the queue now, not when the next
        batch is built: its queue slot returns at once, and its prepare is cancelled if it has not started."""
        if not future.cancelled():
            return
        if not item.prepared.done():
            item.prepared.cancel()
        if self._scheduler.discard(item):
            self._gauge()

    def retry_after_s(self) -> float:
        """Seconds until the work ahead of a new image is done (1 to 60), for Retry-After. The stages overlap
        (the CPU threads prepare later images while the GPU encodes earlier ones), so the backlog drains at
        the slower one's pace: the max of the two, not their sum.
          GPU: the patches queued, in batches of the budget, plus the new image's own batch, x the moving
               batch time.
          CPU: the images admitted or submitted whose prepare has not finished, x the moving prepare time,
               / the CPU threads."""
        gpu_s = (self._scheduler.queued_patches / self._scheduler.budget + 1) * self._batch_s
        cpu_s = (self._permits + self._preparing) * (self._prepare_s or 0.0) / self._cpu_threads
        return float(min(60.0, max(1.0, gpu_s, cpu_s)))

    def _prepared(self, prepared: asyncio.Future) -> None:
        """A prepare ended (done, failed or cancelled): one less in the CPU backlog, the batcher may pack its
        image now; its time feeds the moving average (the first one seeds it)."""
        self._preparing -= 1
        self._wakeup.set()
        if prepared.cancelled() or prepared.exception() is not None:
            return
        seconds = prepared.result()[1] / 1e3
        self._prepare_s = seconds if self._prepare_s is None else 0.8 * self._prepare_s + 0.2 * seconds

    async def warm_up(self, job: Job, *, timeout_s: float | None = None) -> EncodedImage:
        """Encode one image through the whole engine, for readiness; not counted in the metrics (no request
        asked for it)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        (item,) = self.submit([job], deadline=deadline, warmup=True)
        try:
            return await asyncio.wait_for(asyncio.shield(item.future), timeout_s)
        except (asyncio.CancelledError, TimeoutError):
            item.future.cancel()  # dropped from the queue; not answered if it is on the GPU already
            raise

    async def warm_preparers(self, job: Job, *, timeout_s: float | None = None) -> list[float]:
        """Prepare `job` once on every CPU thread (not encoded), for readiness: on CUDA each thread prepares on
        a stream of its own, and its first images there set up what the next ones reuse. The ms each took.
        Unavailable as soon as the engine is down (a thread died, or it is stopping), TimeoutError after
        `timeout_s`."""
        warmed = self._preparers.on_every_thread(job)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = set(warmed)
        try:
            while pending:
                if not self.alive:
                    raise Unavailable(self._down_reason())
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"the CPU threads' warm-up took over {timeout_s} s")
                _, pending = await asyncio.wait(pending, timeout=min(1.0, left) if left is not None else 1.0)
            return [future.result()[1] for future in warmed]
        finally:
            for future in pending:
                future.cancel()  # (a thread that has not started it skips it)

    # ---- batcher (event loop) --------------------------------------------------------------------------
    async def _batch_loop(self) -> None:
        while True:
            await self._slot.acquire()  # the GPU thread has taken the previous batch: at most one waits
            batch: list[WorkItem] = []
            while not batch:  # the images prepared by now (their prepare done, failed or cancelled)
                batch = self._scheduler.next_batch()
                if not batch:
                    self._wakeup.clear()
                    await self._wakeup.wait()  # an image queued, or a prepare ended
            self._gauge()
            ready, inputs = [], []
            now = time.monotonic()
            for item in batch:
                if item.droppable(now):
                    drop(item, now)
                elif item.prepared.cancelled():
                    item.future.cancel()
                elif item.prepared.exception() is not None:  # decode failed: fails this image only
                    item.future.set_exception(item.prepared.exception())
                else:
                    ready.append(item)
                    inputs.append(item.prepared.result())
            if not ready:
                self._slot.release()
                continue
            self._on_gpu.update(ready)
            self._to_gpu.put((ready, inputs))

    def _batcher_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._stopping:
            return
        exc = task.exception()
        log.error("encode batcher died: %r", exc, exc_info=exc)
        self._death = exc or RuntimeError("batcher exited")
        self._fail_all(Unavailable(self._down_reason()))

    # ---- GPU, completion and CPU threads -----------------------------------------------------------------
    def _start_thread(self, name: str, loop_fn: Callable[[], None]) -> threading.Thread:
        """A daemon thread running `loop_fn` whose death is logged and turns the engine down."""
        thread = threading.Thread(target=self._thread_main, args=(loop_fn,), name=name, daemon=True)
        thread.start()
        return thread

    def _thread_main(self, loop_fn) -> None:
        try:
            loop_fn()
        except BaseException as exc:  # noqa: BLE001 - the death is logged, recorded and answered to callers
            log.critical("%s thread died: %r", threading.current_thread().name, exc, exc_info=exc)
            self._death = exc
            self._call_loop(self._fail_all, Unavailable(self._down_reason()))

    def _gpu_loop(self) -> None:
        try:
            self._launch_batches()
        finally:  # however the GPU thread ends, the completion thread ends after the batches in flight
            self._put_in_flight(None)

    def _launch_batches(self) -> None:
        while True:
            work = self._to_gpu.get()
            if work is None:
                return
            self._call_loop(self._slot.release)
            items, inputs = work
            started = time.monotonic()
            try:
                outputs = self._encode([pixel_values for pixel_values, _ in inputs], [it.grid_thw for it in items])
                if len(outputs) != len(items):
                    raise RuntimeError(f"encode returned {len(outputs)} outputs for {len(items)} images")
                rows = self._copier.start(outputs)
            except Exception as exc:  # a failing batch fails its own items; the thread goes on
                self._batch_failed(items, exc)
                continue
            if not self._put_in_flight((items, inputs, rows, started)):  # waits while the previous batch waits
                raise RuntimeError("the completion thread is gone")

    def _put_in_flight(self, work) -> bool:
        """Queue a launched batch (or the end sentinel) for the completion thread; False if it died."""
        while True:
            try:
                self._in_flight.put(work, timeout=0.1)
                return True
            except queue.Full:
                if not self._threads[1].is_alive():
                    return False

    def _complete_loop(self) -> None:
        while True:
            work = self._in_flight.get()
            if work is None:
                return
            items, inputs, rows, started = work
            try:
                outputs = rows.wait()  # the batch's kernels and its copy to the host are done
            except Exception as exc:
                self._batch_failed(items, exc)
                continue
            self._call_loop(self._finish_batch, items, inputs, outputs, started, time.monotonic())

    def _batch_failed(self, items, exc: Exception) -> None:
        log.error("ViT batch of %d images failed", len(items), exc_info=exc)
        self._call_loop(self._fail_batch, items, exc)

    def _call_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: nobody is waiting any more
            log.warning("event loop closed; dropped %s", getattr(fn, "__name__", fn))

    # ---- completion (event loop) -----------------------------------------------------------------------
    def _finish_batch(self, items, inputs, outputs, started: float, ended: float) -> None:
        self._on_gpu.difference_update(items)
        encode_ms = (ended - started) * 1e3
        # Batches overlap (the next one is launched before this one's rows arrive): this batch's own share
        # of the GPU starts when the previous one finished, if that was after its launch.
        self._batch_s = 0.8 * self._batch_s + 0.2 * (ended - max(started, self._last_done))
        self._last_done = ended
        m = self._metrics if not all(it.warmup for it in items) else None  # the warm-up's batch is no request's
        if m is not None:
            m.encode_latency.observe(encode_ms / 1e3)
            m.batch_patches.observe(sum(it.num_patches for it in items))
            m.images_encoded.inc(sum(not it.warmup for it in items))
        for item, (_, prep_ms), rows in zip(items, inputs, outputs):
            queue_ms = (started - item.enqueued_at) * 1e3
            if m is not None and not item.warmup:
                m.queue_latency.observe(queue_ms / 1e3)
                m.preprocess_latency.observe(prep_ms / 1e3)
            if not item.future.done():
                timings = {"preprocess_ms": prep_ms, "queue_ms": queue_ms, "encode_ms": encode_ms,
                           "batch_images": float(len(items))}
                item.future.set_result(EncodedImage(rows=rows, grid_thw=item.grid_thw, timings=timings))

    def _fail_batch(self, items: list[WorkItem], exc: Exception) -> None:
        self._on_gpu.difference_update(items)
        if self._metrics is not None:
            self._metrics.batch_failures.inc()
        err = Unavailable(f"the ViT batch holding this image failed: {type(exc).__name__}: {exc}")
        for item in items:
            if not item.future.done():
                item.future.set_exception(err)

    def _fail_all(self, err: Exception) -> None:
        for item in self._scheduler.drain() + list(self._on_gpu):
            if not item.future.done():
                item.future.set_exception(err)
            if not item.prepared.done():
                item.prepared.cancel()
        self._on_gpu.clear()
        self._gauge()

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.set(len(self._scheduler))

    def _down_reason(self) -> str:
        if self._stopping:
            return "the service is shutting down"
        if self._death is not None:
            return f"the encode engine is down: {type(self._death).__name__}: {self._death}"
        return "the encode engine is not running"


def _timed(job: Job) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    pixel_values = job.reader.prepare(job.data, job.grid_thw)
    return pixel_values, (time.perf_counter() - t0) * 1e3
