"""benchmarks/video_bench.py --small runs to its end for both families with no failed check: the service's grid
and rows against transformers' processor + tower on the same clip (it exits 1 when they differ), every chunk's
rows present, no request error at concurrency 8. No timing is asserted: the numbers are for reading (pytest -s),
not for passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("av")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_video_bench_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.video_bench", "--small"], cwd=ROOT,
                          env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-8000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "checks: all passed" in proc.stdout
    (path,) = tmp_path.glob("video_bench-*.json")
    result = json.loads(path.read_text())
    assert (tmp_path / "video_bench.md").exists() and result["failures"] == []
    assert sorted(r["family"] for r in result["rows"]) == ["qwen2_5_vl", "qwen3_vl"]
    for row in result["rows"]:
        t, h, w = row["grid"]
        assert row["num_tokens"] == t * h * w // 4 == t * row["tokens_per_group"]
        assert row["norm_rel_err"] < 1e-4  # float32 on the CPU: GEMM rounding only
        assert row["throughput"]["errors"] == [] and row["throughput"]["frames"] > 0
