"""Real servers for tests: the whole service (core + uvicorn HTTP + gRPC) on 127.0.0.1, free ports, tiny
random model, running on its own event loop in a background thread (so sync and async tests can both use it).
The end-to-end benchmarks (benchmarks/load_bench.py, scenarios.py, connector_bench.py) run theirs the same way.

The fixtures that start them are in tests/service/conftest.py. A `RunningService` has `.url`
(http://127.0.0.1:port), `.grpc_address` (127.0.0.1:port), `.sglang_url` (with --sglang-protocol: SGLang's
encoder protocol, api/sglang/), `.core` (the EncoderCore), `.checkpoint`, `.settings`, `.call(coro_fn)` to run
a coroutine on the service's loop (the core's asyncio objects belong to that loop), and `.sample(name, labels)`
to read a metric there. `held_decode(svc)` holds its images at their decode step while a test needs them
still encoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from pathlib import Path

from encoder_service.api.service import Service, bind_socket
from encoder_service.settings import Settings
from tests.support.ports import free_port

AUTH_TOKEN = "test-token-123"
START_TIMEOUT_S = 120
TEST_LIMITS = ["--max-images", "8", "--max-body-bytes", "2MiB", "--max-image-bytes", "1MiB",
               "--max-pixels", "4000000", "--max-queue", "64", "--cache-bytes", "256MiB", "--batch-tokens", "4096"]


def make_settings(checkpoint: Path, *extra: str, grpc: bool = True) -> Settings:
    args = ["--model", str(checkpoint), "--host", "127.0.0.1", "--device", "cpu", "--log-level", "warning",
            "--grpc-port", str(free_port()) if grpc else "0", *TEST_LIMITS, *extra]
    return Settings.from_args(args, env={})


class RunningService:
    """`http_sock`: a bound socket to serve HTTP on (default: a free port); `core`: an EncoderCore already
    built (api/service.py: build_core) to serve instead of building one from `settings`."""

    def __init__(self, settings: Settings, checkpoint: Path | None = None, *, http_sock=None, core=None,
                 start_timeout_s: float = START_TIMEOUT_S):
        self.settings, self.checkpoint = settings, checkpoint
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-service-loop", daemon=True)
        self._thread.start()
        sglang_sock = bind_socket("127.0.0.1", 0) if settings.server.sglang_protocol else None
        self.service = Service(settings, core=core, http_sock=http_sock or bind_socket("127.0.0.1", 0),
                               sglang_sock=sglang_sock)
        self.call(self.service.start, timeout=start_timeout_s)
        self.core = self.service.core
        self.url = self.service.http_address
        self.grpc_address = self.service.grpc_address
        self.sglang_url = self.service.sglang_address  # None unless --sglang-protocol

    def call(self, coro_fn, *args, timeout: float = 60):
        """Run `await coro_fn(*args)` on the service's loop and return its result (bounded wait)."""
        fut = asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def pinned(self, public_id: str) -> bool:
        """Whether encode pins of `public_id` are held in the local tier (asked on the service's loop)."""
        core = self.core
        name = core.key_of(public_id).name  # an image's, or a video's frame group's

        async def on_loop():  # the store is not thread-safe
            return core.store.local.is_pinned(name)

        return self.call(on_loop)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample of the core's Prometheus registry (0 when absent), read on the service's loop: a read
        runs every collector, and the cache's reads the store, which belongs to that loop."""

        async def read() -> float:
            return self.core.metrics.registry.get_sample_value(name, labels) or 0.0

        return self.call(read)

    def close(self) -> None:
        try:
            self.call(self.service.stop, timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def running(request, checkpoint: Path, *extra: str) -> RunningService:
    svc = RunningService(make_settings(checkpoint, *extra), checkpoint)
    request.addfinalizer(svc.close)
    return svc


@contextlib.contextmanager
def held_decode(svc: RunningService, timeout_s: float = 60.0):
    """The service's engine holds every image at its decode step (a CPU thread) until the yielded gate is set
    (at the latest on leaving): its encodes are still running, for as long as the test needs (`timeout_s` at
    most: then the decode fails the test)."""
    gate = threading.Event()
    backend = svc.core.images.backend  # what the engine's prepare stage decodes with

    def preprocess(*args, _preprocess=backend.preprocess):
        assert gate.wait(timeout_s), "the test never opened the gate"
        return _preprocess(*args)

    backend.preprocess = preprocess
    try:
        yield gate
    finally:
        gate.set()
        del backend.preprocess  # the class's method again
