"""Captured CUDA graphs (runtime/graphs.py) against the tower run on each image alone, eager: the same
batches as the CPU static-buffer tests (tests/support/graph_cases.py), replayed on the same graphs one after
another, so a stale boundary or window index would show; and a batch for each graph of every bucket the
service captures. Captures that fail: no collection of garbage graphs inside a capture, a failed capture
undone, a runner capturing again after one (tests/unit/test_graph_capture.py: the retry and eager route)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from encoder_service.ops.cuda_graph import capturing
from encoder_service.runtime.graph_capture import CudaCapture
from encoder_service.runtime.graphs import GraphRunner
from encoder_service.runtime.runner import make_runner
from encoder_service.settings import ATTENTION, DEFAULT_BUCKETS
from tests.support import graph_cases as cases


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(loaded, family, dtype):
    lm = loaded(family, "cuda", dtype)
    runner = make_runner(lm, cuda_graphs=True, buckets=cases.BUCKETS)
    assert isinstance(runner, GraphRunner) and runner.describe()["graphs"] == 2 * len(cases.BUCKETS)
    exact = GraphRunner(lm, buckets=cases.BUCKETS, exact_buckets=[64, 96])  # captured exact graphs too
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    seed = 100
    for _ in range(3):
        for grids in cases.SAME_TOTAL_SINGLE + cases.SAME_TOTAL_MULTI + cases.MIXED:
            seed += 1
            cases.check_batch(runner, lm, grids, seed, rtol=tol)
            cases.check_batch(exact, lm, grids, seed, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_service_bucket_replays_like_eager(dtype):
    """make_runner's graphs (settings' ladder + the exact buckets), each graph of each bucket replayed."""
    lm = cases.narrow_tower("cuda", dtype)
    runner = make_runner(lm, cuda_graphs=True, buckets=DEFAULT_BUCKETS, eager_min_patches=None)
    assert isinstance(runner, GraphRunner) and runner.buckets == cases.SERVICE_BUCKETS
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for seed, bucket in enumerate(cases.SERVICE_BUCKETS):
        for grids, kind in cases.bucket_batches(bucket, runner.exact_buckets):
            assert [(g.bucket, g.kind) for _, g in runner.plan(grids)] == [(bucket, kind)]
            cases.check_batch(runner, lm, grids, seed, rtol=tol)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("choice", ATTENTION)
def test_every_attention_choice_replays_like_eager(loaded, family, choice):
    """Each --attention choice (its backends warmed, checked and captured) against the tower run on each
    image alone (the default policy); the runner says which backend served which layout. (The tiny towers'
    head dim is 16: a backend demoted there falls back; test_ops_cuda checks 72 and 80 demote nothing.)"""
    lm = loaded(family, "cuda", torch.bfloat16)
    runner = make_runner(lm, cuda_graphs=True, buckets=cases.BUCKETS, attention=choice)
    attention = runner.describe()["attention"]
    assert attention["choice"] == choice and attention["selected"], attention
    for seed, grids in enumerate(cases.SAME_TOTAL_SINGLE + cases.SAME_TOTAL_MULTI + cases.MIXED):
        cases.check_batch(runner, lm, grids, seed, rtol=2e-2)
    if choice == "torch":
        assert not {"fa4", "triton_short"} & set(attention["selected"].values())


def test_measured_solo_buckets_run_alone_like_eager():
    """A captured runner times, at startup, each exact bucket's images alone (k replays) against packed (one
    multi graph) and runs alone exactly the buckets that measured no slower; either way a batch of them gives
    each image's rows as the tower alone does."""
    lm = cases.narrow_tower("cuda", torch.bfloat16)
    runner = make_runner(lm, cuda_graphs=True, buckets=DEFAULT_BUCKETS)
    timings = runner.describe()["solo_timings"]
    assert timings and set(timings) <= set(runner.exact_buckets)
    for seed, (bucket, t) in enumerate(timings.items()):
        assert t["solo"] == (t["images"] * t["alone_ms"] <= t["packed_ms"]) == (bucket in runner.solo_buckets)
        grids = [cases.one_frame(bucket)] * t["images"]
        kinds = {g.kind if g is not None else "eager" for _, g in runner.plan(grids)}
        assert kinds == ({"exact"} if t["solo"] else {t["packed_route"]})
        cases.check_batch(runner, lm, grids[:3], seed, rtol=2e-2)


# ---- captures that fail (ops/cuda_graph.py, runtime/graph_capture.py) ----------------------------------------


class InCycle:
    """`graph`, held in a reference cycle: freed only by the cyclic collector."""

    def __init__(self, graph):
        self.graph, self.me = graph, self


def test_a_collection_inside_a_capture_destroys_no_graph():
    """CUDA graphs in reference cycles are freed by Python's cyclic collector, which runs at whatever allocation
    crosses its threshold: inside a capture, destroying a graph there invalidated the capture (issue 38, item
    7). `capturing` pauses the collector; here the graphs become garbage inside the capture, with a collection
    due at every allocation, and are collected after it."""
    x = torch.ones(64, device="cuda")
    cycles = []
    for _ in range(4):
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            x.mul_(1)
        cycles.append(InCycle(graph))
    del graph
    collected = weakref.ref(cycles[0])
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            cycles.clear()  # garbage now, inside the capture
            junk = [[i] for i in range(1000)]  # allocations: each would start a collection
            y = x + len(junk)
        gc.collect()
        assert collected() is None
    finally:
        gc.set_threshold(*thresholds)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x + 1000)


def test_a_failed_capture_is_undone():
    """A capture invalidated (a sync inside it) raises, and leaves the thread on its own stream and the caching
    allocator no longer recording into the pool; a capture in a fresh pool then replays."""
    stream, pool = torch.cuda.current_stream(), torch.cuda.graph_pool_handle()
    x = torch.ones(64, device="cuda")
    with pytest.raises(RuntimeError):
        with capturing(torch.cuda.CUDAGraph(), pool):
            x.mul_(2)
            torch.cuda.synchronize()  # not allowed inside a capture: invalidates it
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="not currently recording"):
        torch._C._cuda_endAllocateToPool(x.device.index, pool)  # _undo ended it already
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, torch.cuda.graph_pool_handle()):
        y = x * 3
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 3))


class FailFirst(CudaCapture):
    """The first capture invalidated by a sync inside it (in the runner's pool), the rest as the runner's."""

    def __init__(self):
        super().__init__()
        self.failed = False

    def capture(self, graph) -> None:
        if not self.failed:
            self.failed = True
            with capturing(torch.cuda.CUDAGraph(), self.pool):
                torch.cuda.synchronize()
        super().capture(graph)


def test_a_runner_recovers_from_a_failed_capture(loaded):
    """The runner's largest graph fails once for real, is captured on the retry (in a fresh pool, as every later
    graph), and every graph replays like the tower alone."""
    lm = loaded("qwen2_5_vl", "cuda", torch.bfloat16)
    runner = GraphRunner(lm, buckets=cases.BUCKETS, capturer=FailFirst())
    failures = runner.describe()["capture_failures"]
    assert len(failures) == 1 and failures[0]["bucket"] == max(cases.BUCKETS) and not failures[0]["eager"]
    assert runner.describe()["graphs"] == 2 * len(cases.BUCKETS)
    for seed, grids in enumerate(cases.SAME_TOTAL_SINGLE + cases.SAME_TOTAL_MULTI + cases.MIXED):
        cases.check_batch(runner, lm, grids, seed, rtol=2e-2)
