"""benchmarks/client_cpu.py on a few images: each way it runs gets every image's rows by IPC (it exits 1
otherwise). No timing is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_client_cpu_small(tmp_path):
    env = os.environ | {"OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.client_cpu", "--images", "6", "--concurrency", "2",
                           "--ways", "fetch/channel,hold/http"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| fetch/channel |" in proc.stdout and "| hold/http |" in proc.stdout
    assert "Checks: all passed" in proc.stdout and list(tmp_path.glob("client_cpu-*.json"))
