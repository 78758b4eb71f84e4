"""benchmarks/preprocess_split.py --small (on the CPU, two images per size after the warm-up) runs to its end: its
steps make the backend's own pixel values bit for bit, and each step's median is in the table and the JSON. No
timing is asserted: the numbers are for reading (pytest -s), not for passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.preprocess_split import SIZES, STEPS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_preprocess_split_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.preprocess_split", "--small"], cwd=ROOT,
                          env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True, timeout=180)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Checks: all passed" in proc.stdout
    (path,) = tmp_path.glob("preprocess_split-*.json")
    result = json.loads(path.read_text())
    for size in SIZES:
        assert len(result[size]["images"]) == 2 and all(result[size]["median_ms"][s] > 0 for s in STEPS)
    assert (tmp_path / "preprocess_split.md").exists()
