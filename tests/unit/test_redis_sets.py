"""tests/support/redis_cluster.py against real redis-servers on 127.0.0.1: a node whose port another process
took between its pick and its bind starts on another one (the ports were picked when the set was made, and
bound only in start(): a Sentinel's or a data node's ephemeral port could be taken in between), and a set
that fails to start stops what it started (its processes and its directory leaked)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis

from tests.support import redis_cluster
from tests.support.ports import free_port, free_port_pair
from tests.support.redis_cluster import RedisClusterSet, SentinelSet

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    """A port pair (p, p + 10000) on 127.0.0.1, p + 10000 listened on by another socket, p by a third."""
    port = free_port_pair(10000)
    with socket.create_server(("127.0.0.1", port)) as a, socket.create_server(("127.0.0.1", port + 10000)):
        yield a


def first_then_free(port: int, pick):
    picks = iter([port])
    return lambda *args: next(picks, None) or pick(*args)


def test_a_node_whose_port_was_taken_meanwhile_starts_on_another(monkeypatch, taken):
    port = taken.getsockname()[1]
    monkeypatch.setattr(redis_cluster, "free_port", first_then_free(port, free_port))
    sentinels = SentinelSet(replicas=1, sentinels=1).start()
    try:
        master = sentinels.master()
        assert master.port != port
        with master.client() as client:
            assert client.info("replication")["connected_slaves"] == 1
    finally:
        sentinels.stop()


@pytest.mark.parametrize("which", ["port", "bus port"])
def test_a_cluster_node_whose_port_or_bus_port_was_taken_meanwhile_starts_on_another(monkeypatch, taken, which):
    port = taken.getsockname()[1]
    if which == "bus port":
        taken.close()  # p free again, p + 10000 still listened on
    monkeypatch.setattr(redis_cluster, "free_port_pair", first_then_free(port, free_port_pair))
    cluster = RedisClusterSet(masters=1, replicas=0).start()
    try:
        (master,) = cluster.masters
        assert master.port != port and cluster.healthy()
    finally:
        cluster.stop()


def test_a_set_that_fails_to_start_stops_what_it_started(monkeypatch):
    started = []
    start = redis_cluster._Node.start

    def failing_sentinels(node):
        if node.dir.name.startswith("sentinel"):
            raise RuntimeError("this Sentinel does not start")
        started.append(start(node))
        return started[-1]

    monkeypatch.setattr(redis_cluster._Node, "start", failing_sentinels)
    sentinels = SentinelSet(replicas=1, sentinels=1)
    with pytest.raises(RuntimeError, match="does not start"):
        sentinels.start()
    assert len(started) == 2 and all(node.proc.poll() is not None for node in started)
    assert not sentinels.root.exists()
    with pytest.raises(redis.ConnectionError):
        with started[0].client(socket_timeout=1) as client:
            client.ping()
