"""A GraphRunner's captures (runtime/graph_capture.py) on the CPU: the runner is given a capture that fails on
cue (`FlakyCapture`, through its `capturer=` seam; a capture that does not fail leaves the graph on its static
buffers, as `capture=False` does), so the retry, the eager route of a graph that could not be captured, the
WARNING and the metrics run without a GPU. A dropped runner frees its graphs without the cyclic collector (one
that ran inside a capture invalidated it: ops/cuda_graph.py). tests/gpu/test_graphs_cuda.py fails real captures.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch

from encoder_service.core import EncoderCore, ImageInput
from encoder_service.core.metrics import Metrics
from encoder_service.ops.cuda_graph import gc_paused
from encoder_service.runtime.graphs import GraphRunner
from tests.support.graph_cases import BUCKETS, MIXED, SAME_TOTAL_MULTI, SAME_TOTAL_SINGLE, check_batch
from tests.support.images import image_bytes
from tests.support.reference import assert_close, reference_rows

INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


class FlakyCapture:
    """Fails the first `fails[(bucket, kind)]` captures of those graphs as an invalidated capture does."""

    def __init__(self, fails: dict[tuple[int, str], int]):
        self.fails, self.attempts, self.recoveries = dict(fails), [], 0

    def capture(self, graph) -> None:
        key = (graph.bucket, graph.kind)
        self.attempts.append(key)
        if self.fails.get(key, 0):
            self.fails[key] -= 1
            raise RuntimeError(INVALIDATED)

    def recover(self) -> None:
        self.recoveries += 1


def routes(runner, grids):
    return [(g.bucket, g.kind) if g is not None else "eager" for _, g in runner.plan(grids)]


def test_a_failed_capture_is_tried_once_more(loaded, caplog):
    lm = loaded("qwen2_5_vl")
    capture = FlakyCapture({(128, "multi"): 1})
    with caplog.at_level(logging.WARNING, "encoder_service.runtime"):
        runner = GraphRunner(lm, buckets=BUCKETS, capturer=capture)
    assert capture.attempts.count((128, "multi")) == 2 and capture.recoveries == 1
    assert len(capture.attempts) == 2 * len(BUCKETS) + 1  # every graph once, the failed one twice
    assert runner.describe()["graphs"] == 2 * len(BUCKETS)
    assert runner.describe()["capture_failures"] == [
        dict(bucket=128, kind="multi", errors=[f"RuntimeError: {INVALIDATED}"], eager=False)]
    assert [r.getMessage() for r in caplog.records] == [
        f"CUDA graph 128/multi: capture failed (attempt 1 of 2): RuntimeError: {INVALIDATED}: trying again after a "
        "device sync"]
    assert {routes(runner, grids)[0] for grids in SAME_TOTAL_MULTI} == {(128, "multi")}
    for seed, grids in enumerate(SAME_TOTAL_MULTI):
        check_batch(runner, lm, grids, seed)


def test_a_graph_that_cannot_be_captured_runs_eagerly(loaded, caplog):
    """Two failures: the graph is left out, its batches run eagerly (each image as the tower alone gives it),
    the other graph of its bucket and the other buckets replay as before; a WARNING per attempt and one at the
    end of the captures, and the metrics."""
    lm = loaded("qwen2_5_vl")
    capture = FlakyCapture({(64, "single"): 2})
    with caplog.at_level(logging.WARNING, "encoder_service.runtime"):
        runner = GraphRunner(lm, buckets=BUCKETS, capturer=capture)
    assert capture.recoveries == 2 and (64, "single") not in runner.graphs and (64, "multi") in runner.graphs
    failure = dict(bucket=64, kind="single", errors=[f"RuntimeError: {INVALIDATED}"] * 2, eager=True)
    assert runner.describe()["capture_failures"] == [failure]
    assert runner.describe()["graphs"] == 2 * len(BUCKETS) - 1
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1].endswith(f"(attempt 2 of 2): RuntimeError: {INVALIDATED}: its batches run eagerly")
    assert len(messages) == 3 and messages[2].endswith("; not captured, run eagerly: 64/single")
    assert {routes(runner, grids)[0] for grids in SAME_TOTAL_SINGLE} == {"eager"}
    assert routes(runner, [(1, 2, 2), (1, 4, 4)]) == [(64, "multi")]
    for seed, grids in enumerate(SAME_TOTAL_SINGLE + MIXED):
        check_batch(runner, lm, grids, seed)

    metrics = Metrics()
    metrics.graph_captures(runner.describe())
    sample = metrics.registry.get_sample_value
    assert sample("encoder_graph_capture_failures_total", {"bucket": "64", "kind": "single"}) == 2
    assert sample("encoder_graphs_eager") == 1


def test_an_exact_graph_that_cannot_be_captured_is_not_timed_and_runs_eagerly(loaded):
    """The exact bucket's graph missing, its images run eagerly (alone or packed as plan() says) and the startup
    timing of alone against packed skips it."""
    lm = loaded("qwen3_vl")
    runner = GraphRunner(lm, buckets=BUCKETS, exact_buckets=[96], measure_solo=True,
                         capturer=FlakyCapture({(96, "exact"): 2}))
    assert runner.describe()["solo_timings"] == {} and (96, "exact") not in runner.graphs
    assert routes(runner, [(1, 8, 12)]) == ["eager"]
    check_batch(runner, lm, [(1, 8, 12), (1, 8, 12), (1, 4, 4)], 5)


def test_images_of_an_exact_bucket_whose_graph_failed_are_packed_not_run_alone(loaded):
    """A bucket's exact graph missing, its size is no solo bucket (it stayed one: each such image ran eagerly
    alone, where packed together they replay a multi graph)."""
    lm = loaded("qwen2_5_vl")
    runner = GraphRunner(lm, buckets=BUCKETS, exact_buckets=[96], solo_min_patches=96,
                         capturer=FlakyCapture({(96, "exact"): 2}))
    assert runner.describe()["solo_buckets"] == []
    assert routes(runner, [(1, 8, 12), (1, 8, 12)]) == [(256, "multi")]
    check_batch(runner, lm, [(1, 8, 12), (1, 8, 12)], 6)
    captured = GraphRunner(lm, buckets=BUCKETS, exact_buckets=[96], solo_min_patches=96, capturer=FlakyCapture({}))
    assert routes(captured, [(1, 8, 12), (1, 8, 12)]) == [(96, "exact"), (96, "exact")]


def test_no_capture_means_no_capture_whatever_capturer_is_given(loaded):
    capture = FlakyCapture({})
    runner = GraphRunner(loaded("qwen2_vl"), buckets=BUCKETS, capture=False, capturer=capture)
    assert capture.attempts == [] and runner.describe()["runner"] == "static_buffers"


async def test_a_core_starts_and_serves_with_a_graph_that_could_not_be_captured(make_core, tiny_checkpoint):
    """A serving start never dies of a failed capture: the core's warm-up encode and a request whose image
    lands in that graph's bucket run eagerly; /metrics and the metadata say which graph."""
    built = await make_core("qwen2_5_vl")
    runner = GraphRunner(built.loaded, buckets=BUCKETS, capturer=FlakyCapture({(64, "single"): 2}))
    core = EncoderCore(built.settings, loaded=built.loaded, runner=runner, preprocess_cfg=built.preprocess_cfg,
                       store=built.store)
    await core.start()
    try:
        data = image_bytes(56, 56, 7)  # 16 patch rows: bucket 64, one image (single)
        assert routes(runner, [(1, 4, 4)]) == ["eager"]
        result = await core.encode([ImageInput(data=data)], return_embeddings=True)
        assert_close(result.embeddings[0], reference_rows(tiny_checkpoint("qwen2_5_vl"), data))
        sample = core.metrics.registry.get_sample_value
        assert sample("encoder_graph_capture_failures_total", {"bucket": "64", "kind": "single"}) == 2
        assert sample("encoder_graphs_eager") == 1
        assert core.metadata()["runner"]["capture_failures"][0]["eager"] is True
    finally:
        await core.stop()


def test_a_dropped_runner_frees_its_graphs_without_the_cyclic_collector(loaded):
    """Its graphs (CUDA graphs, on a GPU) go when the runner goes, by reference count: none is left for a
    cyclic collection, which may run inside a later capture (ops/cuda_graph.py)."""
    runner = GraphRunner(loaded("qwen2_vl"), buckets=BUCKETS, capture=False)
    graph = weakref.ref(next(iter(runner.graphs.values())))
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del runner
        assert graph() is None
    finally:
        if was_enabled:
            gc.enable()


def test_running_out_of_memory_is_not_retried(loaded):
    """Too many buckets for the device is a setting to change: the runner's construction raises."""

    class OutOfMemory(FlakyCapture):
        def capture(self, graph) -> None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    capture = OutOfMemory({})
    with pytest.raises(torch.cuda.OutOfMemoryError):
        GraphRunner(loaded("qwen2_vl"), buckets=BUCKETS, capturer=capture)
    assert capture.recoveries == 0


def test_the_collector_stays_paused_until_the_last_capture_on_any_thread_ends():
    """gc_paused is process-wide: with captures on two threads, the first to end turned the collector on again
    in the middle of the other's."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def second() -> None:
        first_in.wait(10)
        with gc_paused():
            second_in.set()
            first_out.wait(10)
            seen["after the first ended"] = gc.isenabled()

    was_enabled = gc.isenabled()
    gc.enable()
    thread = threading.Thread(target=second)
    thread.start()
    try:
        with gc_paused():
            first_in.set()
            assert second_in.wait(10)
        first_out.set()
        thread.join(10)
        assert seen == {"after the first ended": False} and gc.isenabled()
    finally:
        first_out.set()
        thread.join(10)
        if not was_enabled:
            gc.disable()
