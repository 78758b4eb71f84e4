"""benchmarks/common/children.py: a helper process whose command failed says why, and the parent's answer()
raises with that reason instead of a bare "no answer" (the child stays up for the next command); a child module
starts from any working directory."""

from __future__ import annotations

import time

import pytest

from benchmarks.common import children


def test_a_failed_command_is_reported_with_its_reason_and_the_child_answers_the_next(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repo root: the child finds the benchmarks through module_env
    proc = children.start("benchmarks.tests.echo_child")
    try:
        children.tell(proc, "boom")
        with pytest.raises(RuntimeError, match="failed: ValueError: pins are full"):
            children.answer(proc, time.monotonic() + 30)
        children.tell(proc, "hello")
        assert children.answer(proc, time.monotonic() + 30) == {"echo": "hello"}
    finally:
        children.finish([proc])
    assert proc.returncode == 0
