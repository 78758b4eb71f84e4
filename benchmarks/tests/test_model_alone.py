"""benchmarks/common/model_alone.py on the CPU: a row per batch size with the runner's route, the reference the
best batch's images/s, the text a report states it with. A narrow tower; no timing is asserted beyond its
arithmetic."""

from __future__ import annotations

import torch

from benchmarks.common.model_alone import SMALL_BATCHES, model_alone, reference_text, route_of
from encoder_service.runtime.eager import EagerRunner
from encoder_service.runtime.graphs import GraphRunner
from tests.support.graph_cases import narrow_tower, pixels

CPU = torch.device("cpu")
GRIDS = [(1, 4, 4), (1, 4, 8)]  # 16 and 32 patch rows


def test_the_reference_is_the_best_batch():
    lm = narrow_tower("cpu", torch.float32)
    pvs = pixels(GRIDS, lm.spec.patch_dim, 0)
    alone = model_alone(EagerRunner(lm), pvs, GRIDS, CPU, batches=SMALL_BATCHES, seconds=0.0, max_calls=3)
    rows = alone["rows"]
    assert [r["batch"] for r in rows] == list(SMALL_BATCHES) and all(r["calls"] == 3 for r in rows)
    assert [r["patches"] for r in rows] == [16, 16 + 32 + 16 + 32]  # images cycled from the ones given
    for r in rows:
        assert r["route"] == "eager" and r["images_per_s"] == r["batch"] / (r["ms"] / 1e3)
    best = max(rows, key=lambda r: r["images_per_s"])
    assert (alone["batch"], alone["images_per_s"], alone["route"]) == (best["batch"], best["images_per_s"], "eager")
    assert reference_text(alone) == f"{best['images_per_s']:.1f} images/s at batch {best['batch']} (eager)"


def test_a_graph_runner_states_its_graphs():
    """The route names the graphs the runner's plan replays (counted), and eager where it spills."""
    runner = GraphRunner(narrow_tower("cpu", torch.float32), buckets=[64], capture=False)
    assert route_of(runner, [(1, 4, 4)] * 4) == "graph 64/multi"
    assert route_of(runner, [(1, 4, 8)] * 4) == "graph 64/multi x2"
    assert route_of(runner, [(1, 8, 16)]) == "eager"  # 128 patch rows: over the largest bucket
