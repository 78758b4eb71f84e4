"""benchmarks/scale_out.py --small runs every phase to its end (two replica processes and a real redis-server,
load-generator processes, the cross-replica fetches, a replica SIGKILLed, the consumer's paths) with no failed
check: no request error under load, every crossing fetch that was verified equal to the encoding replica's rows,
every path's rows on the consumer equal to the encode's (it exits 1 otherwise). No timing is asserted: the
numbers are for reading (pytest -s), not for passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis_server import find_redis_server

ROOT = Path(__file__).resolve().parents[2]


def _has_redis_server() -> bool:
    try:
        return bool(find_redis_server())
    except RuntimeError:
        return False


@pytest.mark.timeout(300)  # --budget-s 220 (a loaded machine skips no phase) + its bounded waits < 280 s
@pytest.mark.skipif(not _has_redis_server(), reason="needs a redis-server binary")
def test_scale_out_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale_out", "--small", "--budget-s", "220"], cwd=ROOT,
                          env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-8000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Checks: all passed" in proc.stdout
    (path,) = tmp_path.glob("scale_out-*.json")
    result = json.loads(path.read_text())
    assert (tmp_path / "scale_out.md").exists()
    assert all(p["status"] == "done" for p in result["phases"]), result["phases"]
    # one and two replicas per image size, every image of a level answered (the levels are bounded in images)
    assert sorted((r["image"], r["replicas"]) for r in result["scale"]) == [
        ("320x180", 1), ("320x180", 2), ("480x270", 1), ("480x270", 2)]
    for row in result["scale"]:
        assert row["requests"] > 0 and row["errors"] == 0 and row["wrong_rows"] == 0
        if row["replicas"] == 2:  # both replicas encoded, and half of the fetches crossed
            assert all(n > 0 for n in row["encoded_per_replica"]) and row["fetch_other"]["n"] > 0
            assert row["verified"] > 0
    assert all(r["mismatches"] == 0 and r["waited_other"]["n"] > 0 for r in result["latency"])
    # the model alone, from a process built as a replica is, per image size: the reference of every row's %
    alone = result["model_alone"]["tiny qwen3_vl"]
    assert sorted(alone) == ["320x180", "480x270"] and all(a["images_per_s"] > 0 for a in alone.values())
    assert all(row["of_model_alone"] > 0 for row in result["scale"])
    assert "| tiny qwen3_vl | 480x270 | " in proc.stdout and " images/s at batch " in proc.stdout
    (kill,) = result["kill"]
    assert sum(kill["fresh"]["after_kill"].values()) == kill["images"]  # every fresh fetch has an outcome
    paths = {(r["image"], r["key"]) for r in result["transfer"]}
    assert {key for _, key in paths} == {"http", "grpc", "shm grpc", "shm http", "shm grpc, device out",
                                         "ipc", "device copy"}
