"""benchmarks/preprocess_decode.py --small (on the CPU: no nvJPEG, no transformers check without torchvision) runs
to its end: the default backend's steps make its own pixel values bit for bit, and every backend's and step's
median is in the table and the JSON. No timing is asserted: the numbers are for reading (pytest -s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.preprocess_decode import BACKENDS, SIZES, STEPS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_preprocess_decode_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.preprocess_decode", "--small"], cwd=ROOT,
                          env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Checks: all passed" in proc.stdout
    (path,) = tmp_path.glob("preprocess_decode-*.json")
    result = json.loads(path.read_text())
    assert {(r["backend"], r["size"]) for r in result["rows"]} == {(b, s) for b in BACKENDS for s in SIZES}
    assert set(result["steps"]) == set(SIZES) and all(result["steps"][s][step] > 0 for s in SIZES for step in STEPS)
