"""benchmarks/common/children.py: a helper process whose command failed says why, and the parent's answer()
raises with that reason instead of a bare "no answer" (the child stays up for the next command)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks.common import children

ROOT = Path(__file__).resolve().parents[2]
CHILD = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from benchmarks.common import children
for line in sys.stdin:
    try:
        if line.strip() == "boom":
            raise ValueError("pins are full")
        print(json.dumps({{"echo": line.strip()}}), flush=True)
    except Exception as exc:
        print(children.failure(exc), flush=True)
"""


def test_a_failed_command_is_reported_with_its_reason_and_the_child_answers_the_next(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = children.start(str(script))
    try:
        children.tell(proc, "boom")
        with pytest.raises(RuntimeError, match="failed: ValueError: pins are full"):
            children.answer(proc, time.monotonic() + 30)
        children.tell(proc, "hello")
        assert children.answer(proc, time.monotonic() + 30) == {"echo": "hello"}
    finally:
        children.finish([proc])
    assert proc.returncode == 0
