"""benchmarks/transfer_bench.py --small runs to its end with every fetched tensor equal to the encode's rows
(it exits 1 otherwise), and prints each client next to curl; each phase leaves its table and results as it
ends. No timing is asserted: the numbers are for reading (pytest -s), not for passing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_transfer_bench_small(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "N": "1", "P": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.transfer_bench", "--small"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| 640x360 |")]
    assert any("| curl |" in line for line in table) and any("| http |" in line for line in table)
    assert "Checks: all passed" in proc.stdout
    assert list(tmp_path.glob("transfer_bench-*.json")) and (tmp_path / "transfer_bench.md").exists()


def test_each_phase_leaves_its_table_and_results(tmp_path, monkeypatch, capsys):
    """A run cut short (the GPU's time limit) still leaves what it measured: after each phase its table is
    printed and the JSON and markdown hold the phases so far and name those not run; a phase that raises is a
    failed check and the next one runs."""
    from benchmarks import transfer_bench
    from benchmarks.common import report

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(report, "_paths", {})
    run = transfer_bench.Report(dict(date="2026-01-01", commit="abc", setup_s=1.0), "640x360",
                                ["concurrent", "aggregate x2", "encode"], time.perf_counter())
    run.phase("concurrent", "concurrent", lambda checks: [dict(variant="http async", gb_s=1.5, best_gb_s=2.0)])
    row = "| http async | 1.50 | 2.00 |"
    assert row in capsys.readouterr().out
    markdown = (tmp_path / "transfer_bench.md").read_text()
    (path,) = tmp_path.glob("transfer_bench-*.json")
    assert row in markdown and "Not run (yet): aggregate x2, encode" in markdown
    assert json.loads(path.read_text())["concurrent"][0]["gb_s"] == 1.5
    assert json.loads(path.read_text())["not_run"] == ["aggregate x2", "encode"]

    def cut(checks):
        raise RuntimeError("a fetcher died")

    run.phase("aggregate x2", "aggregate", cut)
    run.phase("encode", "encode", lambda checks: [dict(fetch_load="none", encodes=3, p50_ms=20.0, p90_ms=30.0,
                                                       fetched_gb=0.0)])
    markdown = (tmp_path / "transfer_bench.md").read_text()
    assert row in markdown and "| none | 3 | 20.0 | 30.0 | 0.0 |" in markdown and "Not run" not in markdown
    assert "Checks: phase aggregate x2: RuntimeError: a fetcher died" in markdown
    assert json.loads(path.read_text())["failed_checks"] == ["phase aggregate x2: RuntimeError: a fetcher died"]
