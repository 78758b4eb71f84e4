"""benchmarks/latency_bench.py --small (a tiny tower on the CPU, two requests per size after the warm-up) runs to
its end: every request answered, none from the cache, each stage's median in the table and the JSON, beside the
ViT alone. No timing is asserted: the numbers are for reading (pytest -s), not for passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.latency_bench import SIZES, STAGES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_latency_bench_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.latency_bench", "--small"], cwd=ROOT,
                          env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Checks: all passed" in proc.stdout and "| ViT graph alone, batch 1 |" in proc.stdout
    (path,) = tmp_path.glob("latency_bench-*.json")
    result = json.loads(path.read_text())
    assert set(result["sizes"]) == set(SIZES)
    for size in result["sizes"].values():
        assert len(size["requests"]) == 2 and set(STAGES) <= set(size["median_ms"])
        assert size["median_ms"]["client wall"] > 0 and size["vit_alone"]["batch"] == 1
    assert (tmp_path / "latency_bench.md").exists()
