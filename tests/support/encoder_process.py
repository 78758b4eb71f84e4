"""Our service as deployed: an `encoder-service ...` command line (serve, vllm-proxy) in a subprocess, ready
once an HTTP URL answers 200, stopped with SIGTERM (SIGKILL if it does not exit). Used by the engine tiers
(tests/engines/: their venvs have our package without its dependencies, so this imports only the stdlib and
httpx), the replica tests and the benchmarks' replicas (soak.py, scale_out.py, replica_race.py, ...).

  - `main_python()`: the python of the venv that has the service's dependencies: $ENCODER_MAIN_PYTHON, default
    .venv/bin/python (scripts/setup.sh).
  - `encoder_service_argv(*args, python=None, entry=None)`: `encoder-service ARGS` run by that python (or
    `python`); `entry`: another `-m` module and its first arguments that run the CLI (`standin_entry(dir)`:
    tests/support/standin_serve.py, the device row arena on the host stand-in).
  - `ServiceProcess(argv, ready_url, log_path, env=None, name="encoder-service", new_session=False)`: starts
    `argv` (stdout and stderr into `log_path`; with `new_session`, as the leader of a process group of its own)
    on this checkout's code (first on PYTHONPATH), with no ENCODER_* variables of ours (only its command line
    configures it) plus `env`; `wait_ready(timeout_s)` returns it once `ready_url` answers (if it exits or is
    not ready in time: stopped, RuntimeError with the log's tail), `stop()` (idempotent), `log_tail()`; a
    context manager.
  - `Replica(name, checkpoint, redis_url, log_dir, *args, device="cpu", entry=None)`: `encoder-service serve`
    of `checkpoint` on free loopback ports (`.url`, `.grpc_address`, `.target`), sharing `redis_url` (None: no
    Redis), on `device` (None: the service's own default), plus `args`; `wait_ready` starts it again on other
    ports should another process take its port first; `metrics(names=None)` reads its /metrics (needs
    prometheus_client).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import httpx

from tests.support.ports import free_port
from tests.support.waits import wait_for

ROOT = Path(__file__).resolve().parents[2]


def main_python() -> str:
    py = os.environ.get("ENCODER_MAIN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(py).exists():
        raise RuntimeError(f"no main venv python at {py}: run scripts/setup.sh, or set ENCODER_MAIN_PYTHON")
    return py


def encoder_service_argv(*args: str, python: str | None = None, entry: list[str] | None = None) -> list[str]:
    """`encoder-service ARGS` run by `python` (default: the main venv's); `entry`: as the module docstring says."""
    return [python or main_python(), "-m", *(entry or ["encoder_service.cli"]), *args]


def standin_entry(directory: Path) -> list[str]:
    """The `entry` of a serve whose device row arena is the host stand-in's, its files in `directory`."""
    return ["tests.support.standin_serve", str(directory)]


class ServiceProcess:
    def __init__(self, argv: list[str], ready_url: str, log_path: Path, env: dict[str, str] | None = None,
                 name: str = "encoder-service", new_session: bool = False):
        self.argv, self.ready_url, self.log_path, self.name = list(argv), ready_url, Path(log_path), name
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODER_")}
        # This checkout first; what the caller's PYTHONPATH held after it (on the GPU machine, the carried
        # wheels that scripts/gpu/env.sh installs there).
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        child_env.update(PYTHONPATH=path, PYTHONDONTWRITEBYTECODE="1", **(env or {}))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=child_env, cwd=ROOT,
                                     start_new_session=new_session)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 240.0):
        """Returns self once `ready_url` answers 200 (polled: a child starting has nothing to subscribe to)."""
        try:
            wait_for(self._ready, f"{self.name}: {self.ready_url} to answer 200", timeout_s, poll_s=0.2)
        except (RuntimeError, AssertionError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}:\n{self.log_tail()}") from None
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}")
        try:
            return httpx.get(self.ready_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

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


PORT_TRIES = 3  # starts of a replica whose port another process took between free_port() and its bind


class Replica(ServiceProcess):
    def __init__(self, name: str, checkpoint: Path, redis_url: str | None, log_dir: Path, *args: str,
                 device: str | None = "cpu", python: str | None = None, env: dict[str, str] | None = None,
                 entry: list[str] | None = None):
        self._spec = (name, checkpoint, redis_url, Path(log_dir), args, device, python, env, entry)
        self._spawn()

    def _spawn(self) -> None:
        name, checkpoint, redis_url, log_dir, args, device, python, env, entry = self._spec
        self.http_port = free_port()
        self.grpc_port = next(p for p in iter(free_port, None) if p != self.http_port)
        self.url, self.grpc_address = f"http://127.0.0.1:{self.http_port}", f"127.0.0.1:{self.grpc_port}"
        cmd = ["serve", "--model", str(checkpoint), *(["--device", device] if device else []),
               "--host", "127.0.0.1", "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--log-level", "warning", *(["--redis-url", redis_url] if redis_url else []), *args]
        super().__init__(encoder_service_argv(*cmd, python=python, entry=entry), f"{self.url}/health/ready",
                         log_dir / f"{name}.log", env=env, name=f"replica {name}")

    def wait_ready(self, timeout_s: float = 240.0) -> Replica:
        for _ in range(PORT_TRIES - 1):
            try:
                return super().wait_ready(timeout_s)
            except RuntimeError:
                if "cannot listen on" not in self.log_tail():  # settings.py: PortUnavailable, HTTP or gRPC
                    raise
            self._spawn()
        return super().wait_ready(timeout_s)

    @property
    def target(self) -> dict[str, str]:
        return {"http": self.url, "grpc": self.grpc_address}

    def metrics(self, names=None) -> dict[str, float]:
        """The samples of its /metrics whose name is in `names`, summed over their labels; without `names`,
        every sample that has no labels."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names if names is not None else not sample.labels:
                    found[sample.name] = found.get(sample.name, 0.0) + sample.value
        return found


@contextlib.contextmanager
def started(*replicas: Replica):
    """The replicas, ready; stopped on the way out, however it is left."""
    try:
        for r in replicas:
            r.wait_ready()
        yield replicas
    finally:
        for r in replicas:
            r.stop()
