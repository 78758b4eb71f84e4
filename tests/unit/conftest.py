"""Unit tier: one module (or a few) at a time, on the CPU, no servers of ours (a real redis-server where the
cache's Redis tier is under test, from tests/conftest.py). `make_core`: an EncoderCore of a tiny model, started,
its runner optionally behind a gate (GatedRunner)."""

from __future__ import annotations

import threading

import pytest

from encoder_service.api.service import build_core
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


@pytest.fixture
async def make_core(tiny_checkpoint):
    """`await make_core(family="qwen2_5_vl", *flags, gated=False) -> EncoderCore`, started (stopped after the
    test); `gated`: its runner is a GatedRunner (`core.runner`)."""
    cores = []

    async def make(family: str = "qwen2_5_vl", *flags: str, gated: bool = False) -> EncoderCore:
        core = build_core(make_settings(tiny_checkpoint(family), *flags, grpc=False))
        if gated:
            core = EncoderCore(core.settings, loaded=core.loaded, runner=GatedRunner(core.runner),
                               preprocess_cfg=core.preprocess_cfg, store=core.store)
        cores.append(core)
        await core.start()
        if gated:  # the warm-up encode went through the gate: `entered` counts the batches after it
            assert core.runner.entered.acquire(timeout=WAIT_S)
        return core

    yield make
    for core in cores:
        if isinstance(core.runner, GatedRunner):
            core.runner.gate.set()
        await core.stop()
