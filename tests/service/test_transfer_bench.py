"""benchmarks/transfer_bench.py --small runs to its end with every fetched tensor equal to the encode's rows
(it exits 1 otherwise), and prints each client next to curl. No timing is asserted: the numbers are for
reading (pytest -s), not for passing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_transfer_bench_small(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "N": "1", "P": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/transfer_bench.py", "--small"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| 640x360 |")]
    assert any("| curl |" in line for line in table) and any("| http |" in line for line in table)
    assert "Checks: all passed" in proc.stdout
    assert list(tmp_path.glob("transfer_bench-*.json")) and (tmp_path / "transfer_bench.md").exists()
