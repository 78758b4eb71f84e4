"""Replicas as deployed: `encoder-service serve` subprocesses (tests/support/encoder_process.py), each its own
GIL, RSS and (with CUDA_VISIBLE_DEVICES in `env`) GPU, on free 127.0.0.1 ports, HTTP and gRPC."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.common.load import scrape
from tests.support.encoder_process import ServiceProcess, encoder_service_argv
from tests.support.ports import free_port

PORT_TRIES = 3  # starts of a replica whose port another process took between free_port() and its bind


class Replica(ServiceProcess):
    """`serve --model CHECKPOINT` on free ports with `flags` after the common ones (and `--redis-url` when
    given), run by this interpreter; its log in `log_dir/<name>.log`. Started at once: `wait_ready(timeout_s)`
    (which starts it again on other ports when it lost its port to another process). `.url`, `.grpc_address`,
    `.target` ({"http", "grpc"}), `.metrics()`."""

    def __init__(self, name: str, checkpoint: Path, log_dir: Path, *flags: str, redis_url: str | None = None,
                 env: dict[str, str] | None = None):
        self._spec = (name, checkpoint, Path(log_dir), flags, redis_url, env)
        self._spawn()

    def _spawn(self) -> None:
        name, checkpoint, log_dir, flags, redis_url, env = self._spec
        self.http_port = free_port()
        self.grpc_port = next(p for p in iter(free_port, None) if p != self.http_port)
        self.url, self.grpc_address = f"http://127.0.0.1:{self.http_port}", f"127.0.0.1:{self.grpc_port}"
        cmd = ["serve", "--model", str(checkpoint), "--host", "127.0.0.1", "--http-port", str(self.http_port),
               "--grpc-port", str(self.grpc_port), "--log-level", "warning", *flags]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        super().__init__(encoder_service_argv(*cmd, python=sys.executable), f"{self.url}/health/ready",
                         log_dir / f"{name}.log", env=env, name=f"replica {name}")

    def wait_ready(self, timeout_s: float = 240.0) -> Replica:
        tries = 1
        while True:
            try:
                return super().wait_ready(timeout_s)
            except RuntimeError:
                if tries == PORT_TRIES or "Address already in use" not in self.log_tail():
                    raise
            tries += 1
            self._spawn()

    @property
    def target(self) -> dict[str, str]:
        return {"http": self.url, "grpc": self.grpc_address}

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of its /metrics."""
        return scrape(self.url)
