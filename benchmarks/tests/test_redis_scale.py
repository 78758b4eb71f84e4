"""benchmarks/redis_scale.py --small (one worker, two seconds per target, on the CPU) runs to its end against a
real redis-server and a real three-master Redis Cluster: images go through both, every master of the Cluster holds
keys, no errors. No rate is asserted: the numbers are for reading (pytest -s), not for passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_redis_scale_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.redis_scale", "--small"], cwd=ROOT,
                          env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("redis_scale-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["masters"] for r in rows] == [1, 3]
    for row in rows:
        assert row["images"] > 0 and row["errors"] == 0 and row["dropped"] == 0
    assert all(m["keys"] > 0 and m["commands"] > 0 for m in rows[1]["per_master"].values())
    assert (tmp_path / "redis_scale.md").exists()
