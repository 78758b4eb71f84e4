"""Soak: the service under a bounded, mixed encode / fetch / release load for a fixed time, on loopback.

What it proves: memory stays bounded (RSS at start / middle / end of every process), no 5xx and no errors
at all under a long mixed load, and never a wrong row. Not speed: by default it runs the tiny random
checkpoint on the CPU (encoder_service/testing/tiny.py).

Setup (all started here, all stopped at the end): a redis-server on 127.0.0.1 (tests/support/redis_server.py;
allkeys-lru) and N replicas (`python -m encoder_service.cli serve`, subprocesses: their own GIL and their
own RSS) sharing it; with --replicas 1 --no-redis, one replica alone.

Load: --concurrency workers, each running "sessions" (one prompt of an LLM server) until --seconds pass:
  encode   one image (no wait), on a random replica: a new image (new bytes, so a miss that the ViT encodes)
           with probability --new, else one of the last 64 (a hit: local, or Redis on another replica);
  fetch    its rows in two chunks, each on a random replica (with Redis: mostly another replica than the
           encode, often while the encode is still running, so the fetch waits for it there), over HTTP or
           gRPC in turn; one session in 8 also fetches the rows on the encoding replica and compares them
           bit for bit (a mismatch beyond float tolerance is a wrong row; within it, counted apart, rows of
           another encode of the same image by another replica). Without Redis every call of a session goes
           to one replica (as the chart's ClientIP affinity does);
  release  the encode's pin, on the encoding replica.
Every request has a timeout (--request-timeout-s); the whole run a hard limit (--seconds + 120 s).

Prints the setup, requests and errors by status per op, p50 / p99 latency per op, RSS per process, and a
few of the replicas' own counters; writes the same to benchmarks/results/soak-<date>-<commit>.json and
$OUT/soak.md (benchmarks/common/report.py: where, with and without OUT), or the JSON alone to --json. Exit
status 1 on any error status or wrong row.

    python -m benchmarks.soak --seconds 240                  # 2 replicas + Redis, tiny model, CPU
    python -m benchmarks.soak --replicas 1 --no-redis --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.report import stamp, write_result
from benchmarks.common.stats import percentile, rss_mib
from encoder_service import errors
from encoder_service.client import AsyncEncoderClient
from tests.support.encoder_process import Replica
from tests.support.images import image_bytes, png_with_text
from tests.support.redis_server import RedisServer

BASE_SIZES = [(64, 64), (96, 72), (112, 112), (160, 120), (224, 168), (200, 300), (320, 240), (128, 256)]
RECENT = 64  # ids a session may repeat
VERIFY_EVERY = 8  # one session in 8 compares its rows with the encoding replica's
READY_TIMEOUT_S = 180.0
OPS = ("encode", "fetch", "release")


# ---- images: a few base PNGs; "new" bytes are a base with a tEXt chunk naming a counter (a new cache key,
# the same pixels: no PNG compression per request in the load generator) ---------------------------------
def base_pngs(seed: int = 0) -> list[bytes]:
    return [image_bytes(w, h, seed * 100 + k) for k, (w, h) in enumerate(BASE_SIZES)]


# ---- processes ---------------------------------------------------------------------------------------------
class SoakReplica(Replica):
    def __init__(self, name: str, checkpoint: Path, redis_url: str | None, args, log_dir: Path):
        super().__init__(name, checkpoint, redis_url, log_dir, "--cache-bytes", args.cache_bytes,
                         "--lease-s", str(args.lease_s), "--max-queue", "256", python=sys.executable)

    def counters(self) -> dict[str, float]:
        return self.metrics(("encoder_cache_misses_total", "encoder_cache_local_evictions_total",
                             "encoder_cache_redis_writes_total", "encoder_cache_redis_dropped_writes_total",
                             "encoder_cache_redis_pending_waits_total", "encoder_cache_redis_pending_wakeups_total",
                             "encoder_cache_redis_pending_timeouts_total",
                             "encoder_cache_redis_claimed_elsewhere_total",
                             "encoder_cache_redis_pending_orphaned_total", "encoder_pending_unmarked_total",
                             "encoder_cache_reshared_total", "encoder_cache_pinned_bytes",
                             "encoder_cache_local_used_bytes"))


# ---- load --------------------------------------------------------------------------------------------------
class Load:
    def __init__(self, replicas: list[SoakReplica], shared: bool, args):
        self.replicas, self.shared, self.args = replicas, shared, args
        self.bases = base_pngs()
        self.recent: collections.deque[bytes] = collections.deque(maxlen=RECENT)
        self.counter = 0
        self.latency_ms: dict[str, list[float]] = {op: [] for op in OPS}
        self.statuses: dict[str, collections.Counter] = {op: collections.Counter() for op in OPS}
        self.first_errors: dict[str, str] = {}  # "op status" -> the first such error's message
        self.sessions = self.wrong_rows = self.other_encodes = self.cross_replica_fetches = 0
        self.rng = random.Random(args.seed)

    def image(self) -> bytes:
        if not self.recent or self.rng.random() < self.args.new:
            self.counter += 1
            data = png_with_text(self.bases[self.counter % len(self.bases)], self.counter)
            self.recent.append(data)
            return data
        return self.rng.choice(self.recent)

    async def timed(self, op: str, call):
        t0 = time.perf_counter()
        try:
            result = await call
            status = "ok"
        except errors.EncoderServiceError as exc:  # the clients' errors carry the HTTP status or gRPC code
            code = getattr(exc, "status", None)
            result, status = exc, str(getattr(code, "name", code) if code is not None else exc.kind)
        except Exception as exc:  # a client-side bug or a transport failure: counted, never fatal to the soak
            result, status = exc, type(exc).__name__
        self.latency_ms[op].append((time.perf_counter() - t0) * 1e3)
        self.statuses[op][status] += 1
        if status != "ok":
            self.first_errors.setdefault(f"{op} {status}", str(result)[:300])
        return result if status == "ok" else None

    async def session(self, clients: list[dict[str, AsyncEncoderClient]]) -> None:
        self.sessions += 1
        n = self.sessions
        enc = self.rng.randrange(len(clients))
        infos = await self.timed("encode", clients[enc]["http"].encode([self.image()]))
        if infos is None:
            return
        (info,) = infos
        half = info.num_tokens // 2
        parts = []
        for k, (start, end) in enumerate(((0, half), (half, info.num_tokens))):
            where = self.rng.randrange(len(clients)) if self.shared else enc
            self.cross_replica_fetches += where != enc
            transport = "grpc" if (n + k) % 2 else "http"
            got = await self.timed("fetch", clients[where][transport].fetch([(info.id, 0)], start, end))
            parts.append(None if got is None else got.rows)
        if n % VERIFY_EVERY == 0 and all(p is not None for p in parts):
            own = await self.timed("fetch", clients[enc]["http"].fetch([(info.id, 0)], 0, info.num_tokens))
            rows = torch.cat(parts)
            if own is not None and not torch.equal(rows, own.rows):
                # Bit-different but close: two replicas each encoded the image (an id evicted from Redis and
                # from a replica's LRU is encoded again), in batches of other sizes (CPU float32 GEMMs round
                # differently with the row count). Anything further apart is a wrong row.
                close = torch.allclose(rows.float(), own.rows.float(), atol=1e-5, rtol=1e-4)
                self.other_encodes += close
                self.wrong_rows += not close
        await self.timed("release", clients[enc]["grpc" if n % 2 else "http"].release([info.id]))

    async def run(self, seconds: float, on_middle) -> float:
        timeout = self.args.request_timeout_s
        clients = [{"http": AsyncEncoderClient.http(r.url, timeout=timeout),
                    "grpc": AsyncEncoderClient.grpc(r.grpc_address, timeout=timeout)} for r in self.replicas]
        stop_at = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < stop_at:
                await self.session(clients)

        async def middle() -> None:
            await asyncio.sleep(seconds / 2)
            await asyncio.to_thread(on_middle)

        t0 = time.monotonic()
        try:
            await asyncio.gather(middle(), *(worker() for _ in range(self.args.concurrency)))
        finally:
            for pair in clients:
                for client in pair.values():
                    await client.close()
        return time.monotonic() - t0


# ---- report ------------------------------------------------------------------------------------------------
def report(setup: dict, load: Load, elapsed: float, rss: dict[str, dict[str, float]], counters: dict) -> str:
    lines = ["| setup | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in setup.items()]
    total = sum(sum(c.values()) for c in load.statuses.values())
    lines += ["", f"{load.sessions} sessions, {total} requests in {elapsed:.0f} s ({total / elapsed:.1f} req/s); "
                  f"{load.cross_replica_fetches} fetches on another replica than the encode; "
                  f"checked sessions whose rows came from another encode of the image (bit-different, within "
                  f"1e-4): {load.other_encodes}; wrong rows: {load.wrong_rows}", "",
              "| op | requests | by status | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for op in OPS:
        lat = load.latency_ms[op]
        by = ", ".join(f"{s}: {n}" for s, n in sorted(load.statuses[op].items()))
        lines.append(f"| {op} | {len(lat)} | {by} | {percentile(lat, 50):.1f} | {percentile(lat, 99):.1f} |")
    lines += [f"\nfirst {what}: {message}" for what, message in load.first_errors.items()]
    lines += ["", "| process | RSS start MiB | middle | end |", "|---|---|---|---|"]
    for name, at in rss.items():
        lines.append(f"| {name} | {at.get('start', float('nan')):.0f} | {at.get('middle', float('nan')):.0f} | "
                     f"{at.get('end', float('nan')):.0f} |")
    if counters:
        names = sorted({k for c in counters.values() for k in c})
        lines += ["", "| counter | " + " | ".join(counters) + " |", "|---|" + "---|" * len(counters)]
        lines += [f"| {n} | " + " | ".join(f"{c.get(n, 0):.0f}" for c in counters.values()) + " |" for n in names]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--new", type=float, default=0.5, help="share of sessions with a never-seen image")
    p.add_argument("--family", default="qwen2_5_vl")
    p.add_argument("--cache-bytes", default="8MiB", help="each replica's host LRU (small: evictions happen)")
    # Above what a default run writes (~9 KB per new image): Redis never evicts, so every fetch must succeed.
    # A smaller one exercises Redis's LRU too, and then a fetch may find its id evicted (404, by design).
    p.add_argument("--redis-maxmemory", default="256mb")
    p.add_argument("--lease-s", type=float, default=60.0)
    p.add_argument("--request-timeout-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="where the JSON goes (default: benchmarks/results/)")
    args = p.parse_args()
    if args.replicas < 1 or args.concurrency < 1 or args.seconds <= 0:
        p.error("--replicas, --concurrency and --seconds must be positive")

    from encoder_service.testing.tiny import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    checkpoint = build_tiny_checkpoint(args.family, work / args.family)
    redis = None if args.no_redis else RedisServer(maxmemory=args.redis_maxmemory, policy="allkeys-lru").start()
    replicas: list[SoakReplica] = []
    rss: dict[str, dict[str, float]] = collections.defaultdict(dict)

    def sample(at: str) -> None:
        for r in replicas:
            rss[r.name][at] = rss_mib(r.proc.pid)
        if redis is not None:
            rss["redis-server"][at] = rss_mib(redis.proc.pid)
        rss["load generator (this)"][at] = rss_mib()

    try:
        replicas = [SoakReplica(chr(ord("a") + i), checkpoint, redis and redis.url, args, work)
                    for i in range(args.replicas)]
        for r in replicas:
            r.wait_ready(READY_TIMEOUT_S)
        load = Load(replicas, shared=redis is not None, args=args)
        sample("start")
        elapsed = asyncio.run(asyncio.wait_for(load.run(args.seconds, lambda: sample("middle")), args.seconds + 120))
        sample("end")
        counters = {r.name: r.counters() for r in replicas}
    finally:
        for r in replicas:
            r.stop()
        if redis is not None:
            redis.stop()
        print(f"checkpoint and replica logs: {work} (removed when the run passes)", file=sys.stderr)
    setup = stamp() | {
        "machine": f"{os.cpu_count()} CPU cores, {torch.__version__}, Python {sys.version.split()[0]}",
        "model": f"tiny random {args.family} (encoder_service/testing/tiny.py), CPU, float32",
        "replicas": f"{args.replicas} (subprocesses), " + ("no Redis" if redis is None else
                                                          f"one redis-server (maxmemory {args.redis_maxmemory}, "
                                                          "allkeys-lru)"),
        "per replica": f"--cache-bytes {args.cache_bytes} --lease-s {args.lease_s:g}",
        "load": f"{args.concurrency} workers for {args.seconds:g} s, new images {args.new:.0%}",
    }
    text = report(setup, load, elapsed, rss, counters)
    print(text)
    errors_seen = sum(n for c in load.statuses.values() for s, n in c.items() if s != "ok")
    result = {
        "sessions": load.sessions, "elapsed_s": elapsed, "wrong_rows": load.wrong_rows,
        "other_encodes": load.other_encodes,
        "statuses": {op: dict(c) for op, c in load.statuses.items()}, "first_errors": load.first_errors,
        "p50_ms": {op: percentile(v, 50) for op, v in load.latency_ms.items()},
        "p99_ms": {op: percentile(v, 99) for op, v in load.latency_ms.items()},
        "rss_mib": rss, "counters": counters}
    if args.json is None:
        write_result("soak", setup, result, text + "\n")
    else:
        args.json.write_text(json.dumps({"setup": setup, **result}, indent=2))
    if errors_seen or load.wrong_rows:
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
