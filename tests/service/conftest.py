"""Service tier: the whole service (core + uvicorn HTTP + grpc.aio) on 127.0.0.1 with tiny random models.

Fixtures (session scope, built on first use), each a `tests.support.service.RunningService`:
  - `service`:        qwen2_5_vl, small limits (TEST_LIMITS), no auth.
  - `service_qwen3`:  qwen3_vl (deepstack rows), same limits.
  - `auth_service`:   qwen2_vl with --auth-token AUTH_TOKEN.
  - `shm_service`, `shm_service_qwen3`: like `service` / `service_qwen3` with --shm-fetch, --shm-dir `shm_dir`.
Module scope: `shared_redis`, one redis-server for a module's replicas.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer
from tests.support.service import AUTH_TOKEN, RunningService, running


@pytest.fixture(scope="session")
def service(request, tiny_checkpoint) -> RunningService:
    return running(request, tiny_checkpoint("qwen2_5_vl"))


@pytest.fixture(scope="session")
def service_qwen3(request, tiny_checkpoint) -> RunningService:
    return running(request, tiny_checkpoint("qwen3_vl"))


@pytest.fixture(scope="session")
def auth_service(request, tiny_checkpoint) -> RunningService:
    return running(request, tiny_checkpoint("qwen2_vl"), "--auth-token", AUTH_TOKEN)


@pytest.fixture(scope="module")
def shared_redis():
    """One redis-server for a module's replicas (64 MB, allkeys-lru)."""
    server = RedisServer(maxmemory="64mb", policy="allkeys-lru").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shm_dir(tmp_path_factory) -> Path:
    """The --shm-dir of the shm services (a private directory, so tests can plant links and odd files)."""
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="session")
def shm_service(request, tiny_checkpoint, shm_dir) -> RunningService:
    return running(request, tiny_checkpoint("qwen2_5_vl"), "--shm-fetch", "--shm-dir", str(shm_dir))


@pytest.fixture(scope="session")
def shm_service_qwen3(request, tiny_checkpoint, shm_dir) -> RunningService:
    return running(request, tiny_checkpoint("qwen3_vl"), "--shm-fetch", "--shm-dir", str(shm_dir))

