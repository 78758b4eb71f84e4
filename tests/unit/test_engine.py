"""Engine and scheduler: packing order and budget, failure isolation, thread death, backpressure (and its
Retry-After, which counts the CPU preprocessing backlog), deadlines and cancellation. The engine is built
with its stages: a fake prepare (a job's data is a number: its pixel values are filled with it) and a fake
encode function in place of the tower (no model needed)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from encoder_service.engine.engine import Engine, Job
from encoder_service.engine.scheduler import Scheduler, WorkItem, batch_budget
from encoder_service.errors import DeadlineExceeded, ImageDecodeError, Overloaded, Unavailable

WAIT_S = 10  # bound on every wait in this file


def _item(loop, n: int, deadline=None, prepared: bool = True, requester=None) -> WorkItem:
    """An image of n patches, its prepare done (`prepared`) or still running; `requester`: who asked (None: it
    alone)."""
    item = WorkItem(grid_thw=(1, 1, n), prepared=loop.create_future(), future=loop.create_future(), deadline=deadline,
                    **({} if requester is None else {"requester": requester}))
    if prepared:
        item.prepared.set_result(None)
    return item


async def test_packing_keeps_order_and_budget():
    loop = asyncio.get_running_loop()
    s = Scheduler(budget=8)
    a = [_item(loop, n) for n in (3, 3, 3)]
    b = [_item(loop, n) for n in (8, 1)]
    c = [_item(loop, 20)]  # over the budget: a batch of its own
    d = [_item(loop, 2), _item(loop, 2)]
    for req in (a, b, c, d):
        s.push(req)
    batches = [s.next_batch() for _ in range(6)]
    assert len(s) == 0
    assert [[it.num_patches for it in bt] for bt in batches] == [[3, 3], [3], [8], [1], [20], [2, 2]]
    flat = [it for bt in batches for it in bt]
    assert flat == a + b + c + d  # arrival order of requests, placeholder order inside each
    assert [(it.seq, it.index) for it in a] == [(1, 0), (1, 1), (1, 2)]
    assert s.queued_patches == 0


async def test_images_still_preparing_keep_their_place_and_hold_back_only_their_own_requester():
    loop = asyncio.get_running_loop()
    s = Scheduler(budget=8)
    big = [_item(loop, 3, prepared=False, requester="big"), _item(loop, 3, requester="big")]
    other = [_item(loop, 3, prepared=False), _item(loop, 2)]
    s.push(big)
    s.push(other)
    assert s.next_batch() == [other[1]]  # prepared, and nothing of its requester ahead of it still preparing
    assert s.next_batch() == [] and len(s) == 3 and s.queued_patches == 9
    big[0].prepared.set_result(None)
    assert s.next_batch() == [big[0], big[1]]  # in their order
    urgent = [_item(loop, 2, prepared=False)]
    urgent[0].urgent = True
    s.push(urgent)
    other[0].prepared.set_result(None)
    assert s.next_batch() == []  # nothing passes an urgent image still being prepared
    urgent[0].prepared.set_result(None)
    assert s.next_batch() == [urgent[0], other[0]] and len(s) == 0 and s.queued_patches == 0


def test_budget_is_capped_by_the_largest_bucket():
    assert batch_budget(16384, (1024, 4096)) == 4096
    assert batch_budget(2048, (1024, 4096)) == 2048
    assert batch_budget(3000, ()) == 3000


async def test_dead_items_are_dropped_before_a_batch_is_built():
    loop = asyncio.get_running_loop()
    s = Scheduler(budget=100)
    now = time.monotonic()
    keep1, gone, expired, keep2 = (_item(loop, 4), _item(loop, 4), _item(loop, 4, deadline=now - 1), _item(loop, 4))
    s.push([keep1, gone, expired, keep2])
    gone.wanted = lambda: False  # its callers all left
    assert s.next_batch(now) == [keep1, keep2]
    assert gone.future.cancelled()
    with pytest.raises(DeadlineExceeded, match="deadline"):
        expired.future.result()
    assert s.queued_patches == 0


class FakeTower:
    """The engine's encode stage: rows = pixel_values[:, :2] * 2; a batch containing a NaN raises; `gate`
    holds the GPU thread so tests can build queues; `calls` records the batches (first pixel of each image)."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.calls: list[list[float]] = []
        self.die = False

    def __call__(self, pixel_values, grids):
        self.entered.release()
        assert self.gate.wait(WAIT_S)
        if self.die:
            raise _ThreadKiller("simulated fatal GPU error")
        self.calls.append([float(pv[0, 0]) for pv in pixel_values])
        if any(torch.isnan(pv).any() for pv in pixel_values):
            raise RuntimeError("NaN in batch")
        return [pv[:, :2] * 2 for pv in pixel_values]


class _ThreadKiller(BaseException):
    pass


def prepare(tag: float, grid_thw) -> torch.Tensor:
    """The engine's prepare stage: [t*h*w patches, 3] pixel values filled with the job's tag; a negative tag
    is an image that does not decode."""
    if tag < 0:
        raise ImageDecodeError(f"image {tag} is corrupt")
    t, h, w = grid_thw
    return torch.full((t * h * w, 3), tag)


class TagReader:
    """The jobs' reader: `prepare` above."""

    prepare = staticmethod(prepare)


def _job(tag: float, patches: int = 4) -> Job:
    return Job(tag, (1, 2, patches // 2), TagReader)


async def _entered(tower: FakeTower) -> None:
    assert await asyncio.to_thread(tower.entered.acquire, True, WAIT_S)


@pytest.fixture
async def engine_and_tower():
    tower = FakeTower()
    engine = Engine(encode=tower, batch_tokens=8, max_queue=6, cpu_threads=2)
    await engine.start()
    yield engine, tower
    tower.gate.set()
    await engine.stop()


async def _results(items):
    return await asyncio.wait_for(asyncio.gather(*(it.future for it in items), return_exceptions=True), WAIT_S)


async def test_engine_batches_in_order_and_answers(engine_and_tower):
    engine, tower = engine_and_tower
    tower.gate.clear()
    first = engine.submit([_job(1.0)])
    await _entered(tower)  # the GPU thread holds batch [1]; the rest queue up behind it
    second = engine.submit([_job(2.0), _job(3.0), _job(4.0)])
    third = engine.submit([_job(5.0)])
    tower.gate.set()
    out = await _results(first + second + third)
    assert [float(r.rows[0, 0]) for r in out] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert out[1].rows.shape == (4, 2) and out[1].grid_thw == (1, 2, 2)
    assert {"preprocess_ms", "queue_ms", "encode_ms"} <= set(out[0].timings)
    order = [t for call in tower.calls for t in call]
    assert sorted(order) == [1.0, 2.0, 3.0, 4.0, 5.0] and order[0] == 1.0
    assert [t for t in order if t in (2.0, 3.0, 4.0)] == [2.0, 3.0, 4.0]  # a request's images in their order
    assert all(sum(1 for _ in call) * 4 <= 8 for call in tower.calls)  # budget 8 = two 4-patch images


async def test_failing_batch_fails_only_its_requests(engine_and_tower):
    engine, tower = engine_and_tower
    tower.gate.clear()
    ok_before = engine.submit([_job(1.0)])
    await _entered(tower)
    bad = engine.submit([_job(float("nan")), _job(7.0)])
    ok_after = engine.submit([_job(3.0)])
    corrupt = engine.submit([_job(-1.0)])  # fails in preprocessing: only this image
    tower.gate.set()
    r_before, r_bad1, r_bad2, r_after, r_corrupt = await _results(ok_before + bad + ok_after + corrupt)
    # Which images share the NaN's batch depends on the order the CPU threads finish preparing them (the
    # requesters' jobs are taken in turn): each image fails exactly when its batch held the NaN.
    (failed,) = [call for call in tower.calls if any(math.isnan(t) for t in call)]
    assert isinstance(r_bad1, Unavailable) and "NaN in batch" in str(r_bad1)
    for tag, result in ((1.0, r_before), (7.0, r_bad2), (3.0, r_after)):
        if tag in failed:
            assert isinstance(result, Unavailable) and "NaN in batch" in str(result)
        else:
            assert float(result.rows[0, 0]) == 2 * tag
    assert 1.0 not in failed  # its batch ran first, alone
    assert isinstance(r_corrupt, ImageDecodeError)
    assert engine.alive
    (again,) = await _results(engine.submit([_job(9.0)]))
    assert float(again.rows[0, 0]) == 18.0


async def test_backpressure_overloaded_with_retry_after(engine_and_tower):
    engine, tower = engine_and_tower
    tower.gate.clear()
    running = engine.submit([_job(1.0)])
    await _entered(tower)
    queued = engine.submit([_job(2.0) for _ in range(6)])  # max_queue=6 (one batch may already be handed off)
    with pytest.raises(Overloaded, match="max_queue is 6") as info:
        engine.submit([_job(3.0) for _ in range(6)])
    assert info.value.retry_after_s >= 1
    tower.gate.set()
    assert all(not isinstance(r, Exception) for r in await _results(running + queued))
    assert engine.queue_depth == 0


async def test_retry_after_grows_with_the_preprocessing_backlog():
    """The GPU is idle and its queue short; the one CPU thread is the bottleneck: Retry-After must say so."""
    cpu_free = threading.Event()

    def slow_prepare(data: tuple[float, bool], grid_thw) -> torch.Tensor:
        tag, hold = data
        time.sleep(0.1)  # a big image's decode and resize
        assert not hold or cpu_free.wait(WAIT_S)
        return prepare(tag, grid_thw)

    def slow(tag: float, hold: bool = False) -> Job:
        return Job((tag, hold), (1, 2, 2), SlowReader)

    class SlowReader:
        prepare = staticmethod(slow_prepare)

    engine = Engine(encode=FakeTower(), batch_tokens=64, max_queue=64, cpu_threads=1)
    await engine.start()

    try:
        await _results(engine.submit([slow(1.0)]))  # one prepare measured: >= 0.1 s on the one thread
        assert engine.retry_after_s() == 1.0  # nothing ahead: the floor
        backlog = engine.submit([slow(2.0, hold=True)] + [slow(3.0) for _ in range(19)])
        permits = engine.admit(10)  # admitted, not submitted yet: their prepare is ahead too
        # 30 images x >= 0.1 s / 1 thread: >= 3 s of CPU work ahead (the GPU's: 80 patches, 2 short batches)
        with_permits = engine.retry_after_s()
        assert with_permits >= 2.99
        for permit in permits:
            permit.release()
        assert 1.99 <= engine.retry_after_s() < with_permits  # 20 x >= 0.1 s
        cpu_free.set()
        assert all(not isinstance(r, Exception) for r in await _results(backlog))
        assert engine.retry_after_s() == 1.0
    finally:
        cpu_free.set()
        await engine.stop()


async def test_admission_counts_permits_until_submitted_or_released(engine_and_tower):
    engine, tower = engine_and_tower
    tower.gate.clear()
    running = engine.submit([_job(1.0)])
    await _entered(tower)
    permits = engine.admit(4)  # max_queue=6
    with pytest.raises(Overloaded, match="4 images waiting, max_queue is 6, this request adds 3"):
        engine.admit(3)  # all or none
    assert engine.permits == 4
    submitted = engine.submit([_job(2.0), _job(3.0)], permits=permits[:2])  # no second check
    permits[2].release()
    permits[2].release()  # idempotent
    assert engine.permits == 1
    with pytest.raises(Overloaded):
        engine.submit([_job(4.0) for _ in range(6)])  # without permits: admitted here
    assert engine.permits == 1
    permits[3].release()
    tower.gate.set()
    assert all(not isinstance(r, Exception) for r in await _results(running + submitted))
    assert engine.permits == 0 and engine.queue_depth == 0


async def test_deadline_and_cancel_drop_queued_items(engine_and_tower):
    engine, tower = engine_and_tower
    tower.gate.clear()
    running = engine.submit([_job(1.0)])
    await _entered(tower)
    waiting = engine.submit([_job(2.0), _job(2.5)])  # the one batch allowed to wait for the GPU
    expired = engine.submit([_job(3.0)], deadline=time.monotonic() - 0.001)
    cancelled = engine.submit([_job(4.0)])
    cancelled[0].wanted = lambda: False  # its only caller left
    later = engine.submit([_job(5.0)])
    tower.gate.set()
    r = await _results(running + waiting + expired + cancelled + later)
    assert isinstance(r[3], DeadlineExceeded)
    assert isinstance(r[4], asyncio.CancelledError)
    assert float(r[5].rows[0, 0]) == 10.0
    seen = [t for call in tower.calls for t in call]
    assert 3.0 not in seen and 4.0 not in seen  # dropped before any batch was built


async def test_gpu_thread_death_is_noticed():
    tower = FakeTower()
    engine = Engine(encode=tower, batch_tokens=8, max_queue=8, cpu_threads=1)
    await engine.start()
    try:
        tower.die = True
        (r,) = await _results(engine.submit([_job(1.0)]))
        assert isinstance(r, Unavailable) and "simulated fatal GPU error" in str(r)
        await asyncio.to_thread(engine._threads[0].join, WAIT_S)
        assert not engine.alive
        with pytest.raises(Unavailable, match="engine is down"):
            engine.submit([_job(2.0)])
    finally:
        await engine.stop()


async def test_a_reservation_holds_its_room_and_its_items_count_once(engine_and_tower):
    """A reservation (a video's window) counts its size until closed, whatever it has queued: its own items
    are not counted again, and a later item of it needs no room (the queue may have filled meanwhile)."""
    engine, tower = engine_and_tower
    tower.gate.clear()
    running = engine.submit([_job(1.0)])
    await _entered(tower)
    reservation = engine.reserve(3)  # max_queue=6
    with pytest.raises(Overloaded, match="3 images waiting, max_queue is 6, this request adds 4"):
        engine.admit(4)
    mine = engine.submit([_job(2.0), _job(3.0)], permits=[reservation.permit(), reservation.permit()])
    others = engine.submit([_job(4.0) for _ in range(3)])  # 3 reserved + 3: full
    with pytest.raises(Overloaded):
        engine.admit(1)
    later = engine.submit([_job(5.0)], permits=[reservation.permit()])  # its own room: no check
    assert engine.queue_depth == 6 and engine.permits == 3
    reservation.close()
    reservation.close()  # idempotent
    assert engine.permits == 0
    with pytest.raises(RuntimeError, match="closed"):
        reservation.permit()
    tower.gate.set()
    assert all(not isinstance(r, Exception) for r in await _results(running + mine + others + later))
    engine.admit(6)  # everything drained: the reserved items left no count behind


async def test_urgent_jobs_go_to_the_front_in_their_order(engine_and_tower):
    engine, tower = engine_and_tower
    tower.gate.clear()
    running = engine.submit([_job(1.0)])
    await _entered(tower)
    queued = engine.submit([_job(2.0), _job(3.0)])
    urgent = engine.submit([Job(4.0, (1, 2, 2), TagReader, urgent=True), Job(5.0, (1, 2, 2), TagReader, urgent=True)])
    tower.gate.set()
    await _results(running + queued + urgent)
    assert [t for call in tower.calls for t in call] == [1.0, 4.0, 5.0, 2.0, 3.0]


async def test_the_cpu_threads_take_from_requests_in_turn():
    """One request's four images, then another request's one: the CPU thread (one here) takes from the two in
    turn, each request's images in order, not first come, first served per image; an urgent job first."""
    started: list[float] = []  # the tags, in the order their prepare started
    first_taken, go = threading.Event(), threading.Event()

    def recording_prepare(tag: float, grid_thw) -> torch.Tensor:
        started.append(tag)
        first_taken.set()
        assert go.wait(WAIT_S)  # the first prepare holds the thread until every job is queued
        return prepare(tag, grid_thw)

    class RecordingReader:
        prepare = staticmethod(recording_prepare)

    def job(tag: float, requester, urgent: bool = False) -> Job:
        return Job(tag, (1, 2, 2), RecordingReader, requester=requester, urgent=urgent)

    big, small, fetch = object(), object(), object()
    engine = Engine(encode=FakeTower(), batch_tokens=64, max_queue=16, cpu_threads=1)
    await engine.start()
    try:
        items = engine.submit([job(1.0, big), job(1.1, big), job(1.2, big), job(1.3, big)])
        assert await asyncio.to_thread(first_taken.wait, WAIT_S)
        items += engine.submit([job(2.0, small)])
        items += engine.submit([job(3.0, fetch, urgent=True)])
        go.set()
        assert all(not isinstance(r, Exception) for r in await _results(items))
        assert started == [1.0, 3.0, 1.1, 2.0, 1.2, 1.3]
    finally:
        go.set()
        await engine.stop()


def _start_thread(name: str, target) -> threading.Thread:
    """Preparers' thread starter, as the engine's is (a daemon thread, started)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


async def test_a_job_cancelled_before_a_thread_starts_it_is_never_prepared():
    """The cancelled future's job leaves the queue in a done callback, which runs on the loop later: a thread
    that took the job meanwhile decoded it all the same."""
    from encoder_service.engine.preparers import Preparers
    from tests.support.waits import wait_for

    prepared, go = [], threading.Event()

    def record(job: str) -> str:
        prepared.append(job)
        if job == "first":  # it holds the one thread
            assert go.wait(WAIT_S)
        return job

    preparers = Preparers(record, 1, _start_thread)
    try:
        first = preparers.submit("first", "a")
        wait_for(lambda: prepared == ["first"], "the first job on the thread", WAIT_S)
        cancelled = preparers.submit("cancelled", "b")
        cancelled.cancel()
        go.set()
        # The loop held (no callback runs) until the thread took the cancelled job from the queue.
        wait_for(lambda: not preparers._line, "the thread to take the cancelled job", WAIT_S)
        last = preparers.submit("last", "c")
        assert await asyncio.wait_for(asyncio.gather(first, last), WAIT_S) == ["first", "last"]
        assert prepared == ["first", "last"]
    finally:
        go.set()
        preparers.stop()


async def test_every_thread_prepares_the_warm_up_job_once_before_the_jobs_queued_after_it():
    """Preparers.on_every_thread (the start-up warm-up on CUDA: each thread's own stream): one prepare per
    thread, by that thread, ahead of the jobs queued meanwhile; the engine's warm_preparers returns each one's
    ms."""
    from encoder_service.engine.preparers import Preparers
    from tests.support.waits import wait_for

    prepared, lock, go = [], threading.Lock(), threading.Event()

    def record(job: str) -> str:
        with lock:
            prepared.append((job, threading.current_thread().name))
        if job == "hold":
            assert go.wait(WAIT_S)
        return job

    preparers = Preparers(record, 3, _start_thread)
    try:
        held = preparers.submit("hold", "a")  # one thread busy: its warm-up waits for it, the others' do not
        wait_for(lambda: len(prepared) == 1, "the held job on a thread", WAIT_S)
        warmed = preparers.on_every_thread("warm")
        later = [preparers.submit(f"job{k}", "b") for k in range(6)]
        go.set()
        assert await asyncio.wait_for(asyncio.gather(*warmed), WAIT_S) == ["warm"] * 3
        await asyncio.wait_for(asyncio.gather(held, *later), WAIT_S)
        warm_threads = [name for job, name in prepared if job == "warm"]
        assert sorted(warm_threads) == sorted(t.name for t in preparers.threads)
        for name in warm_threads:  # on each thread, the warm-up came before any later job
            on_thread = [job for job, n in prepared if n == name and job != "hold"]
            assert on_thread[0] == "warm"
    finally:
        go.set()
        preparers.stop()


async def test_warm_preparers_prepares_on_every_cpu_thread_and_encodes_nothing():
    tower = FakeTower()
    engine = Engine(encode=tower, batch_tokens=8, max_queue=6, cpu_threads=3)
    await engine.start()
    try:
        ms = await engine.warm_preparers(_job(5.0), timeout_s=WAIT_S)
        assert len(ms) == 3 and all(m >= 0 for m in ms)
        assert tower.calls == [] and engine.queue_depth == 0
    finally:
        await engine.stop()
