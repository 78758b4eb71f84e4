"""benchmarks/mlp_kernels/ without a GPU, so that its one H100 run cannot fail on the harness: the item
lists and layouts, the attention candidate the e2e section gets (fastest passing, never a wrong one), variant
names with commas reaching the workers whole, the driver with a fake worker (a crash in the middle, the
report written), the report's tables, and the engine closed loop of the service section on a tiny tower on
the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.common.report import read_records
from benchmarks.mlp_kernels import driver, kernels, report, service

ROOT = Path(__file__).resolve().parents[2]


def test_items_are_unique_and_the_essentials_come_first():
    assert kernels.items() == kernels.NEW  # the next run measures only what was not measured yet
    items = kernels.items(sweep=True)
    assert len(items) == len(set(items)) and set(kernels.NEW) <= set(items)
    assert items[:4] == ["mlp/q25_1080p/cublas_gemm_only", "mlp/q25_1080p/split",
                         "mlp/q25_1080p/triton_fused[m128n128k64s3w8p]", "mlp/q25_1080p/quack[default]"]
    assert items[-1] == "mlp/q25_1080p/inductor_max_autotune"
    for name, lay in kernels.attention_layouts().items():
        cands = [i.split("/")[2] for i in items if i.startswith(f"attn/{name}/")]
        assert cands[0] == "fa4" and ("fa4_dense" in cands) == (len(lay["cu"]) == 2)
    assert kernels.parse_tile(kernels.tile_name((128, 176, False, True))) == (128, 176, False, True)


def test_attention_layouts_are_the_towers():
    lays = kernels.attention_layouts()
    multi = lays["q3_4x720p_multi"]
    lengths = [b - a for a, b in zip(multi["cu"], multi["cu"][1:])]
    assert multi["cu"][-1] == 14400 and lengths[:4] == [3520] * 4 and sum(lengths) == 14400
    assert multi["max_seqlen"] == 14400 and lengths[4] == 14400 - 4 * 3520  # the graph's dummy segment
    assert lays["q3_1080p"]["cu"] == [0, 8160] and lays["q25_1080p"]["D"] == 80
    assert kernels.flops("attn/q3_1080p/fa4") == 4.0 * 8160**2 * 72 * 16


def _kernel(ms, ok=True):
    num = dict(ok=ok, rel_l2=3e-3 if ok else 0.5, nan=0, max_abs=0.1)
    return dict(kind="item", status="ok" if ok else "wrong", ok=ok, ms=ms, eager=num, graph=num)


def test_the_attention_candidate_is_the_fastest_passing_and_never_a_wrong_one():
    recs = [dict(item="attn/q3_1080p/fa4", **_kernel(0.70)),
            dict(item="attn/q3_1080p/fa4_tiles[192,128,smem,ol]", **_kernel(0.60, ok=False)),
            dict(item="attn/q3_1080p/fa4_dense", **_kernel(0.66)),
            dict(item="attn/q3_720p/fa4_dense", **_kernel(0.10))]
    assert report.choices(report.final_records(recs)) == {"attention_72": "fa4_dense"}
    recs.append(dict(item="attn/q3_1080p/fa4_dense", **_kernel(0.75)))  # later record of the same item wins
    assert report.choices(report.final_records(recs))["attention_72"] is None  # fa4 itself is fastest


def test_variant_names_with_commas_reach_the_worker_whole():
    """The first run split its variant list on ',' and crashed on fa4_tiles[192,144,smem,ol]."""
    import argparse
    import json

    variants = ["cublaslt", "auto", "attn:fa4_tiles[192,144,smem,ol]"]
    args = argparse.Namespace(variants=json.dumps(variants), sweep=False)
    items = driver.worker_items("e2e_q3", args)
    assert items[:3] == [f"e2e/qwen3_vl/{v}" for v in variants] and "service/host_copy" in items


def test_driver_survives_a_worker_crash_and_writes_the_report(tmp_path):
    env = dict(os.environ, MLP_KERNELS_FAKE_WORKER="1", OUT=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "benchmarks.mlp_kernels", "--budget-s", "120", "--sections",
                          "kernels,e2e_q25", "--sweep"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "worker attempt 1 exit 7" in res.stdout and "worker attempt 2 exit 0" in res.stdout
    md = (tmp_path / "mlp_kernels.md").read_text()
    assert "crashed: worker exit 7" in md  # the item the first worker died in
    finals = report.final_records(read_records(str(tmp_path / "mlp_kernels.jsonl")))
    assert set(kernels.items(sweep=True)) <= set(finals)  # every kernel item has a record, the crashed one too
    assert [i for i in finals if i.startswith("e2e/")] == ["e2e/qwen2_5_vl/split", "e2e/qwen2_5_vl/auto"]
    assert "| qwen2_5_vl | 1080p | auto |" in md and "mlp swiglu:quack; attn fa4" in md
    short = res.stdout[res.stdout.index("model | case | variant | replay ms | parity"):].splitlines()  # printed last
    assert any(line.startswith("qwen2_5_vl | 1080p | split |") for line in short)
    picked = report.choices(finals)["attention_72"]  # from the sweep's fake timings: named for an e2e_q3 run
    assert short[-1] == f"attention for Qwen3 e2e: {picked}" and short[-2].startswith("kernel ")


def test_service_and_readme_tables_render():
    copy = dict(images=4, mb=115.3, torch_threads=16, start_ms=0.1, start_first_ms=30.0, d2h_gpu_ms=2.4, d2h_gb_s=48.0,
                clone_ms=20.0, clone_gb_s=5.8, clone_faults=28160, clone_steady_ms=12.0, free_ms=3.0,
                clone_1thread_ms=40.0, copy_reused_ms=8.0, copy_reused_gb_s=14.4, pool_fresh_ms=19.0,
                pool_fresh_faults=28164, thp_fresh_ms=6.0, thp_fresh_faults=60, pool_reused_ms=3.5,
                pool_reused_faults=0)
    recs = [dict(kind="item", item="service/host_copy", status="ok", qwen3_4x720p=copy, qwen2_5_3x720p=copy),
            dict(kind="item", item="service/runner_alone", status="ok",
                 batch_1=dict(images_per_s=90.0, graphs=["3520/exact"]),
                 batch_4=dict(images_per_s=95.0, graphs=["14400/multi"])),
            dict(kind="item", item="service/engine[pil,8,pool,window]", status="ok", variant="pil,8,pool,window",
                 images_per_s=70.0, mean_images_per_batch=3.9, gpu_thread_host_ms_per_batch=1.0,
                 completion_wait_ms_per_batch=30.0, minor_faults_per_image=12.0, pool=dict(reused=50, fresh=9)),
            dict(kind="item", item="service/engine[pil,8,clone,all]", status="unavailable",
                 why="No module named 'av': the service's wheels are missing here"),
            dict(kind="item", item="readme/qwen3_vl", status="ok", folder="o/readme_qwen3_vl", markdown="| a | b |")]
    md, _, short = report.render(recs, 1.0)
    row = ("| qwen3_4x720p | 115.3 | 0.10; 30.0 | 2.40 | 48.0 | 20.00 (28160) | 5.8 | 12.00 | 3.00 | 40.00 | 8.00 "
           "| 14.4 | 19.00 (28164) | 6.00 (60) | 3.50 (0) |")
    assert row in md
    assert "4: 95.0 images/s (14400/multi)" in md
    assert "| pil,8,pool,window | 70.0 | 3.90 | 1.00 | 30.00 | 12 | 50 / 9 | ok |" in md
    assert "unavailable: No module named 'av'" in md and "### qwen3_vl (o/readme_qwen3_vl)\n\n| a | b |" in md
    assert short.splitlines()[-2:] == ["engine pil,8,pool,window: 70.0 images/s", "readme/qwen3_vl: ok"]


def test_engine_closed_loop_on_a_tiny_tower_on_the_cpu():
    from encoder_service.models.loader import load_model
    from encoder_service.runtime.runner import EagerRunner
    from encoder_service.testing.tiny import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_checkpoint("qwen3_vl", tmp)
        loaded = load_model(tmp, device="cpu", dtype=torch.float32)
    runner = EagerRunner(loaded)
    jpegs = service.distinct_jpegs(12, 100, size=(320, 240))
    for variant in ("pil,2,pool,window", "predecoded,2,pinned,all", "predecoded,2,clone,all"):
        rec = service.engine_run(runner, variant, jpegs, loaded, concurrency=4, warmup=2, window=4)
        assert rec["images"] == 12 and rec["grid"] == (1, 16, 20) and rec["images_per_s"] > 0
        assert 1 <= rec["mean_images_per_batch"] <= 4
        assert rec["pool"]["reused"] == rec["pool"]["fresh"] == 0  # CPU outputs are owned already: no copy


def test_e2e_variant_on_tiny_towers_on_the_cpu():
    from benchmarks.mlp_kernels import e2e

    fam = e2e.Family("qwen2_5_vl", small=True)
    recs, runner = e2e.run_variant(fam, "auto")
    assert runner is None and [r["case"] for r in recs] == list(e2e.SMALL["cases"])
    for r in recs:  # float32 on the CPU: ours equals transformers' float32 up to GEMM rounding
        assert r["parity_ok"] and r["ours_vs_fp32"] < 1e-5 and r["encode_ms"] > 0 and "replay_ms" not in r
    assert [r["graphs"] for r in recs] == [["256/single"], ["256/multi"]]


@pytest.mark.parametrize("variant", service.ENGINE_VARIANTS)
def test_engine_variants_parse(variant):
    source, threads, rows, kept = variant.split(",")
    assert source in ("torchvision", "pil", "predecoded") and int(threads) > 0
    assert rows in ("pool", "pool_thp", "clone", "pinned") and kept in ("all", "window")
