"""benchmarks/attention/candidates.py without a GPU: its layouts are the graphs' real ones, the work list
(who serves what, priority passes), the table's pass/fail marking, and the driver's crash / hang / budget
handling with a fake worker (ATTN_BENCH_FAKE_WORKER=1), so the one H100 run cannot get stuck."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

from benchmarks.attention import candidates as b
from benchmarks.attention import triton_split as S
from encoder_service.ops import attention as A

ROOT = Path(__file__).resolve().parents[2]


def test_layouts_are_the_graphs_layouts():
    layouts = {lay["name"]: lay for lay in b.build_layouts()}
    for lay in layouts.values():
        cu = lay["cu"]
        assert len(cu) == lay["slots"] + 1 and cu[0] == 0 and cu[-1] == lay["N"]
        assert all(y >= x for x, y in zip(cu, cu[1:])) and max(y - x for x, y in zip(cu, cu[1:])) <= lay["max_seqlen"]
        assert lay["cls"] == A.layout_class(lay["N"], lay["slots"], lay["max_seqlen"])
    assert {name: lay["cls"] for name, lay in layouts.items()} == {
        "q3_1080p": A.ONE, "q25_1080p": A.ONE, "q25_1080p_win": A.WINDOWS, "q3_720p": A.ONE,
        "q3_1024x960_single": A.PADDED_SINGLE, "q25_1036x1036_single": A.PADDED_SINGLE,
        "q3_8x448_multi": A.SEVERAL, "q25_8x448_multi": A.SEVERAL, "q3_8x448_eager": A.SEVERAL,
        "q25_8x448_eager": A.SEVERAL, "q25_8x448_win_multi": A.WINDOWS}
    assert layouts["q3_1080p"]["N"] == 8160 and layouts["q25_1080p"]["N"] == 10764 and layouts["q3_720p"]["N"] == 3520
    # 8 x 784 patches go to the multi graph of the exact 1080p bucket (8160), as GraphRunner.plan does
    assert layouts["q3_8x448_multi"]["N"] == 8160 and layouts["q3_8x448_multi"]["max_seqlen"] == 8160
    assert layouts["q3_8x448_multi"]["slots"] == 33 and layouts["q3_8x448_multi"]["segments"] == 9  # + the dummy
    assert layouts["q25_8x448_multi"]["cu"][-26:] == [8192] * 26  # 25 zero-length filler slots
    assert layouts["q3_1024x960_single"]["real_rows"] == 3840 and layouts["q3_1024x960_single"]["N"] == 4096


def test_work_items():
    layouts = b.build_layouts()
    by = {lay["name"]: lay for lay in layouts}
    items = b.work_items(layouts, b.CANDIDATES)
    assert sorted(items) == sorted(b.display_items(layouts, b.CANDIDATES)) and len(set(items)) == len(items)
    passes = [b._pass_of(c) for _, c in items]
    assert passes == sorted(passes) and b._pass_of(items[-1][1]) == 3
    for name, cand in items:
        lay, base = by[name], cand.split("[")[0]
        if base in A.BACKENDS:
            assert A.BACKENDS[base].serves(lay["cls"], lay["D"])
        if base == "fa4_dense" or base.startswith("torch_sdpa_"):
            assert lay["slots"] * lay["max_seqlen"] == lay["N"]  # equal-length layouts only
    assert ("q25_1080p_win", "triton_short") in items and ("q3_1080p", "triton_short") not in items
    assert ("q3_1024x960_single", "torch_two_segment") in items and ("q3_1080p", "torch_two_segment") not in items
    assert all((lay["name"], "auto") in items for lay in layouts)  # the service's own pick, every layout
    # the rejected split kernel: measured (every block config), never as a production backend
    assert "triton_split" not in A.BACKENDS and "triton_split" not in b.PRODUCTION
    assert ("q3_1080p", f"triton_split[{b.TRITON_LONG[0]}]") in items
    assert ("q25_1080p_win", f"triton_split[{b.TRITON_SHORT[0]}]") in items
    assert set(b.TRITON_LONG + b.TRITON_SHORT) <= set(S.SPLIT_CONFIGS)
    assert {b._pass_of(c) for _, c in items if c.startswith("triton_split")} == {2}


def test_render_marks_failures_and_ranks_per_class():
    layouts = [lay for lay in b.build_layouts() if lay["name"] == "q3_1080p"]
    good = dict(ok=True, max_abs=1e-3, rel_l2=1e-3, nan_rows=0)
    recs = [
        dict(kind="item", layout="q3_1080p", candidate="fa4", status="ok", ms_eager=0.8, ms_graph=0.7,
             eager_num=good, graph_num=good, rng_ok_after=True, notes=[]),
        dict(kind="item", layout="q3_1080p", candidate="triton_split[m128n64w8s2]", status="ok", ms_eager=0.5,
             ms_graph=0.5, eager_num=good, graph_num=dict(ok=False, max_abs=9.0, rel_l2=1.0, nan_rows=7),
             rng_ok_after=True, notes=[]),
        dict(kind="item", layout="q3_1080p", candidate="torch_sdpa_cudnn", status="ok", ms_eager=0.6,
             ms_graph=0.6, eager_num=good, graph_num=good, rng_ok_after=False, notes=[]),
        dict(kind="item", layout="q3_1080p", candidate="cudnn_fe_backend", status="unavailable", notes=["no cudnn"]),
        dict(kind="item", layout="q3_1080p", candidate="torch_dense", status="started"),
    ]
    items = [("q3_1080p", c) for c in ("fa4", "triton_split[m128n64w8s2]", "torch_sdpa_cudnn", "cudnn_fe_backend",
                                       "torch_dense", "torch_varlen")]
    text, _, winners = b.render(layouts, items, recs, 1.0)
    assert winners["q3_1080p"]["best"] == ("fa4", 0.7)  # faster ones failed the graph check / broke the RNG
    assert winners["q3_1080p"]["production"] == ("fa4", 0.7)
    assert "GRAPH NUMERICS FAIL" in text and "unavailable" in text and "crashed/hung" in text
    assert "not run (time budget)" in text and "- one, D=72 (q3_1080p): fa4 0.700" in text


def test_rejected_split_kernel_host_helpers():
    """benchmarks/attention/triton_split.py (the rejected candidate): its host-side ints."""
    assert S.split_head_dim(80) == (64, 16) and S.split_head_dim(72) == (64, 16)
    assert S.split_head_dim(64) == (64, 0) and S.split_head_dim(96) == (64, 32) and S.split_head_dim(128) == (128, 0)
    assert [S.seg_p2(s) for s in (1, 31, 32, 33, 180, 1024)] == [32, 32, 64, 64, 256, 2048]
    assert S.split_config(64).name == "m64n64w4s2" and S.split_config(8160).name == "m128n64w8s2"
    rng = random.Random(0)
    for _ in range(2000):  # the grid bound covers every layout with these ints
        block = rng.choice([64, 128])
        slots = rng.randint(1, 40)
        lengths = [rng.choice([0, 0, 1, rng.randint(1, 300)]) for _ in range(slots)]
        bound = max(lengths) + rng.choice([0, 0, 5, 100])
        need = sum(math.ceil(x / block) for x in lengths)
        assert S.num_block_slots(sum(lengths), slots, bound, block) >= need


def run_driver(tmp_path, *args, **env):
    environment = dict(os.environ, ATTN_BENCH_FAKE_WORKER="1", OUT=str(tmp_path), **env)
    p = subprocess.run([sys.executable, "-m", "benchmarks.attention.candidates", *args], cwd=ROOT, env=environment,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    (result,) = tmp_path.glob("attention_candidates-*.json")  # with OUT set, the JSON goes there
    return json.loads(result.read_text())


def test_driver_restarts_crashed_workers_and_skips_a_candidate_that_keeps_crashing(tmp_path):
    summary = run_driver(tmp_path, "--layouts", "q3_1080p,q25_1080p,q3_720p,q25_1080p_win", "--candidates",
                         "auto,fa4,triton_split", ATTN_BENCH_FAKE_CRASH_CAND="fa4")
    fa4 = [r["status"] for r in summary["results"] if r["candidate"] == "fa4"]
    assert fa4.count("crashed") == 2 and fa4.count("skipped") == 2 and summary["worker_restarts"] == 2
    assert all(r["status"] == "ok" for r in summary["results"] if r["candidate"] != "fa4")
    assert len(summary["results"]) == len(b.work_items(b.select_layouts(type("A", (), dict(
        layouts="q3_1080p,q25_1080p,q3_720p,q25_1080p_win"))), ["auto", "fa4", "triton_split"]))
    assert "Best per layout" in (tmp_path / "attention_candidates.md").read_text()


def test_driver_kills_a_hung_worker_and_respects_the_budget(tmp_path):
    summary = run_driver(tmp_path, "--layouts", "q3_1080p,q3_720p", "--candidates", "torch_varlen,fa4",
                         "--stall-s", "2", "--budget-s", "90", ATTN_BENCH_FAKE_HANG_CAND="fa4")
    fa4 = [r["status"] for r in summary["results"] if r["candidate"] == "fa4"]
    assert fa4 == ["hung/killed", "hung/killed"]  # each killed after 2 s of silence, not after the budget
    assert summary["wall_s"] < 90


def test_service_graph_is_the_graph_runners_choice():
    import torch

    from encoder_service.runtime.graphs import GraphRunner
    from encoder_service.runtime.runner import exact_resolution_buckets
    from encoder_service.settings import DEFAULT_BUCKETS
    from tests.support.graph_cases import narrow_tower

    lm = narrow_tower("cpu", torch.float32)  # patch 14, merge 2: Qwen2.5's buckets
    runner = GraphRunner(lm, buckets=DEFAULT_BUCKETS, capture=False, eager_min_patches=None,
                         exact_buckets=exact_resolution_buckets(lm.spec, max(DEFAULT_BUCKETS)))
    for grids in ([(1, 78, 138)], [(1, 74, 74)], [(1, 32, 32)] * 8, [(1, 30, 46)], [(1, 52, 92)], [(2, 16, 16)]):
        (batch, graph), = runner.plan(grids)
        assert b.service_graph(grids, 14) == (graph.bucket, graph.kind), grids
