"""A benchmark's helper processes (load generators, consumers): the benchmark's own module with a hidden flag,
driven over pipes: one command line in, one JSON line out, every answer awaited within a deadline. And how any
benchmark starts another process of the benchmarks: `python -m benchmarks.<name>`, this checkout on its path."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module ARGS` in this interpreter (a benchmark runs as a module, never as a file)."""
    return [sys.executable, "-m", module, *args]


def module_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with this checkout first on PYTHONPATH, so that a child started with
    `module_command` imports the benchmarks whatever its working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def start(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m module ARGS` with pipes to talk to it (stderr stays the parent's: its logs show up there)."""
    return subprocess.Popen(module_command(module, *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=module_env(env))


def tell(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def answer(proc: subprocess.Popen, deadline: float) -> dict:
    """The child's next line (JSON), by `deadline` (time.monotonic()); else the child is killed (it hung) and
    RuntimeError says so. A child whose command failed answers {"failed": why} (`failure`): RuntimeError too."""
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise RuntimeError(f"{' '.join(proc.args[2:4])} gave no answer (exit {proc.poll()})")
    got = json.loads(line)
    if "failed" in got:
        raise RuntimeError(f"{' '.join(proc.args[2:4])} failed: {got['failed']}")
    return got


def failure(exc: BaseException) -> str:
    """What a child answers when its command raised `exc` (it stays up for the next one)."""
    return json.dumps(dict(failed=f"{type(exc).__name__}: {exc}"[:500]))


def finish(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """End of input for each child; one that does not exit in time is killed."""
    for proc in procs:
        try:
            proc.stdin.close()
        except OSError:  # already gone
            pass
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def share(n: int, part: int, parts: int) -> int:
    """Child `part`'s share of `n` (workers or images) split over `parts` children."""
    return n // parts + (part < n % parts)
