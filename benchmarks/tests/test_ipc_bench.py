"""benchmarks/ipc_bench.py --small (tiny Qwen3-VL on the CPU, the device row arena's host stand-in) runs every part
to its end with every fetched tensor equal to the socket fetch's (it exits 1 otherwise), the fetches by IPC
served by IPC, the same-host channel against HTTP included. No timing is asserted: the numbers are for reading
(pytest -s), not for passing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_ipc_bench_small(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "N": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.ipc_bench", "--small", "--e2e-s", "1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "Checks: all passed" in out and "Skipped" not in out
    assert "| 1080p | " in out and "(GPU to GPU) | ipc |" in out  # part 2: the IPC row served by IPC
    assert "| cpu | ipc | ipc |" in out and "| cpu | shm | shm |" in out  # part 3: both connector modes
    assert "| ipc | cpu | 4 |" in out and "{'ipc':" in out  # part 4: the closed loop fetched by IPC
    assert out.count("The model alone at its best batch: ") == 1 and "% of the model alone: " in out
    assert "| ipc-hold | cpu | 4 |" in out  # part 4: the encode's answers carried the holds
    assert "| 2 | cpu | channel |" in out and "| 2 | cpu | http |" in out  # part 5: both ways, --runs 2
    assert "{transport=channel}" in out  # the channel served fetches
    assert list(tmp_path.glob("ipc_bench-*.json")) and (tmp_path / "ipc_bench.md").exists()
