"""Pytest fixtures for a real Redis server. Register with `pytest_plugins = ["tests.conftest_redis"]`
(tests/conftest.py belongs to someone else)."""

from __future__ import annotations

import pytest

from redis_server import RedisServer


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
