"""Our service as deployed: an `encoder-service ...` command line (serve, vllm-proxy) in a subprocess, ready
once an HTTP URL answers 200, stopped with SIGTERM (SIGKILL if it does not exit). Used by the engine tiers
(tests/engines/: their venvs have our package without its dependencies, so this imports only the stdlib and
httpx) and benchmarks/soak.py.

  - `main_python()`: the python of the venv that has the service's dependencies: $ENCODER_MAIN_PYTHON, default
    .venv/bin/python (scripts/setup.sh).
  - `encoder_service_argv(*args, python=None)`: `encoder-service ARGS` run by that python (or `python`).
  - `ServiceProcess(argv, ready_url, log_path, env=None, name="encoder-service", new_session=False)`: starts
    `argv` (stdout and stderr into `log_path`; with `new_session`, as the leader of a process group of its own)
    on this checkout's code (PYTHONPATH), with no ENCODER_* variables of ours (only its command line
    configures it) plus `env`; `wait_ready(timeout_s)` returns it once `ready_url` answers (if
    it exits or is not ready in time: stopped, RuntimeError with the log's tail), `stop()` (idempotent),
    `log_tail()`; a context manager.
  - `Replica(name, checkpoint, redis_url, log_dir, *args)`: `encoder-service serve` of `checkpoint` on the CPU
    on free loopback ports (`.url`, `.grpc_address`), sharing `redis_url` (None: no Redis), plus `args`;
    `metrics(names)` reads those samples from its /metrics (needs prometheus_client).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def main_python() -> str:
    py = os.environ.get("ENCODER_MAIN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(py).exists():
        raise RuntimeError(f"no main venv python at {py}: run scripts/setup.sh, or set ENCODER_MAIN_PYTHON")
    return py


def encoder_service_argv(*args: str, python: str | None = None) -> list[str]:
    """`encoder-service ARGS` run by `python` (default: the main venv's)."""
    return [python or main_python(), "-m", "encoder_service.cli", *args]


class ServiceProcess:
    def __init__(self, argv: list[str], ready_url: str, log_path: Path, env: dict[str, str] | None = None,
                 name: str = "encoder-service", new_session: bool = False):
        self.argv, self.ready_url, self.log_path, self.name = list(argv), ready_url, Path(log_path), name
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODER_")}
        child_env.update(PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1", **(env or {}))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=child_env, cwd=ROOT,
                                     start_new_session=new_session)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 240.0):
        """Returns self once `ready_url` answers 200 (polled: a child starting has nothing to subscribe to)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.ready_url, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name}: {self.ready_url} not ready in {timeout_s:g} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the service stops gracefully
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Replica(ServiceProcess):
    def __init__(self, name: str, checkpoint: Path, redis_url: str | None, log_dir: Path, *args: str,
                 python: str | None = None):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url, self.grpc_address = f"http://127.0.0.1:{self.http_port}", f"127.0.0.1:{self.grpc_port}"
        cmd = ["serve", "--model", str(checkpoint), "--device", "cpu", "--host", "127.0.0.1",
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--log-level", "warning",
               *(["--redis-url", redis_url] if redis_url else []), *args]
        super().__init__(encoder_service_argv(*cmd, python=python), f"{self.url}/health/ready",
                         Path(log_dir) / f"{name}.log", name=f"replica {name}")

    def metrics(self, names) -> dict[str, float]:
        """The samples of its /metrics whose name is in `names` (summed over their labels)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    found[sample.name] = found.get(sample.name, 0.0) + sample.value
        return found
