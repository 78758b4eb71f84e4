"""Captured CUDA graphs (runtime/graphs.py) against the tower run on each image alone, eager: the same
batches as the CPU static-buffer tests (tests/support/graph_cases.py), replayed on the same graphs one after
another, so a stale boundary or window index would show; and a batch for each graph of every bucket the
service captures."""

from __future__ import annotations

import pytest
import torch

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
