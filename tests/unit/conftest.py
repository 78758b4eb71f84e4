"""Unit tier: one module (or a few) at a time, on the CPU, no servers of ours (a real redis-server where the
cache's Redis tier is under test, from tests/conftest.py). `make_core`: an EncoderCore of a tiny model, started,
its runner optionally behind a gate (tests/support/cores.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
async def make_core(tiny_checkpoint):
    """`await make_core(family="qwen2_5_vl", *flags, gated=False) -> EncoderCore`, started (stopped after the
    test); `gated`: its runner is a GatedRunner (`core.runner`)."""
    from tests.support.cores import Cores  # here, not at import: the torchvision tier has no uvicorn

    cores = Cores(tiny_checkpoint)
    yield cores.make
    await cores.stop()
