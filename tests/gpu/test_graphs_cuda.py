"""Captured CUDA graphs (runtime/graphs.py) against the tower run on each image alone, eager: the same
batches as the CPU static-buffer tests (tests/support/graph_cases.py), replayed on the same graphs one after
another, so a stale boundary or window index would show."""

from __future__ import annotations

import pytest
import torch

from encoder_service.runtime.graphs import GraphRunner
from encoder_service.runtime.runner import make_runner
from tests.support.graph_cases import BUCKETS, MIXED, SAME_TOTAL_MULTI, SAME_TOTAL_SINGLE, check_batch


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(loaded, family, dtype):
    lm = loaded(family, "cuda", dtype)
    runner = make_runner(lm, cuda_graphs=True, buckets=BUCKETS)
    assert isinstance(runner, GraphRunner) and runner.describe()["graphs"] == 2 * len(BUCKETS)
    exact = GraphRunner(lm, buckets=BUCKETS, exact_buckets=[64, 96])  # captured exact graphs too
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    seed = 100
    for _ in range(3):
        for grids in SAME_TOTAL_SINGLE + SAME_TOTAL_MULTI + MIXED:
            seed += 1
            check_batch(runner, lm, grids, seed, rtol=tol, atol=tol)
            check_batch(exact, lm, grids, seed, rtol=tol, atol=tol)
