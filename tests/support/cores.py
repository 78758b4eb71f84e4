"""EncoderCores of tiny models for the unit tests (tests/unit/conftest.py's `make_core`): built by the service's
own builder (api/service.py: build_core), started, optionally with the runner behind a gate (GatedRunner).

Imported by the fixture when a test asks for it, not by the conftest at import: the torchvision tier runs some
unit modules in a venv without the servers' packages (uvicorn, grpc)."""

from __future__ import annotations

import threading

from encoder_service.api.service import build_core, redis_tier
from encoder_service.core import EncoderCore
from tests.support.service import make_settings

WAIT_S = 20  # bound on the gate's waits


class GatedRunner:
    """The core's runner behind a gate: while `gate` is clear, the GPU thread holds its batch (`entered`
    says it got there), so a test can build a queue behind it."""

    def __init__(self, runner):
        self._runner, self.buckets = runner, runner.buckets
        self.gate, self.entered = threading.Event(), threading.Semaphore(0)
        self.gate.set()

    def encode(self, pixel_values, grid_thw):
        self.entered.release()
        assert self.gate.wait(WAIT_S)
        return self._runner.encode(pixel_values, grid_thw)

    def describe(self) -> dict:
        return self._runner.describe()


class Cores:
    """`await make(family="qwen2_5_vl", *flags, gated=False) -> EncoderCore`, started; `stop()` stops them all
    (gates opened first); `gated`: its runner is a GatedRunner (`core.runner`)."""

    def __init__(self, tiny_checkpoint):
        self._checkpoint, self._cores = tiny_checkpoint, []

    async def make(self, family: str = "qwen2_5_vl", *flags: str, gated: bool = False) -> EncoderCore:
        core = build_core(make_settings(self._checkpoint(family), *flags, grpc=False))
        if gated:
            core = EncoderCore(core.settings, loaded=core.loaded, runner=GatedRunner(core.runner),
                               preprocess_cfg=core.preprocess_cfg, store=core.store, redis=redis_tier(core.settings))
        self._cores.append(core)
        await core.start()
        if gated:  # the warm-up encode went through the gate: `entered` counts the batches after it
            assert core.runner.entered.acquire(timeout=WAIT_S)
        return core

    async def stop(self) -> None:
        for core in self._cores:
            if isinstance(core.runner, GatedRunner):
                core.runner.gate.set()
            await core.stop()
