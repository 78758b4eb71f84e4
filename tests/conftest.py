"""Fixtures every tier shares: tiny random-weight checkpoints and real redis-servers on loopback.

Tiers, each with its own conftest.py: unit/ (modules on their own), service/ (the real HTTP and gRPC servers over
the real core), deploy/ (Dockerfile, Helm chart and scripts, offline), gpu/ (skipped without CUDA), engines/
(vLLM's, SGLang's and torchvision's own code, each in the venv scripts/tiers/<name>.sh builds; skipped in the main
venv).
Helpers the tiers share (test images, a redis-server runner, the in-process service, client builders) are
in support/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torch

from encoder_service.models.loader import load_model
from encoder_service.testing.tiny import build_tiny_checkpoint
from tests.support.redis_server import RedisServer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(family) -> Path`: a tiny checkpoint of that family (built on first use, then reused;
    treat it as read-only, copy it to modify it)."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny_checkpoints")

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_checkpoint(family, root / family)
        return built[family]

    return get


@pytest.fixture
def redis_server():
    """A fresh redis-server per test: maxmemory 8mb, allkeys-lru, persistence off, 127.0.0.1 only."""
    server = RedisServer(maxmemory="8mb", policy="allkeys-lru").start()
    yield server
    server.stop()


@pytest.fixture
def redis_server_noevict():
    """A small server that refuses writes when full (the default policy): for OOM tests."""
    server = RedisServer(maxmemory="2mb", policy="noeviction").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def loaded(tiny_checkpoint):
    """`loaded(family, device="cpu", dtype=torch.float64) -> LoadedModel` of the tiny checkpoint; cached per
    (family, device, dtype)."""
    cache = {}

    # float64 on the CPU: an image's rows alone and in any batch or padding agree to about 1e-15 of their
    # scale (GEMMs of other shapes may round differently: never bit for bit on every BLAS), so a test can
    # hold them to 1e-12 while any boundary or padding error shows at 1e-2 and above.
    def get(family, device="cpu", dtype=torch.float64):
        key = (family, device, dtype)
        if key not in cache:
            cache[key] = load_model(tiny_checkpoint(family), device=device, dtype=dtype)
        return cache[key]

    return get
