"""Encodes per distinct image when two replicas are asked for the same new images at once.

Behind one Service the same image may reach two replicas together (two LLM servers, a retry that lands
elsewhere). Each replica claims an image it accepts in Redis (SET NX of its pending marker, replicas/directory.py):
the first claim encodes it, the other replica waits for those rows. Measured as the ViT's work: the sum over
the replicas of `encoder_images_encoded_total`, per distinct image (1.0: never encoded twice; the issue's
measurement before the claim: 74-79 encodes per 40 images, 1.85-1.98).

Setup (all started here, all stopped at the end): a redis-server on 127.0.0.1 and two replicas
(`python -m encoder_service.cli serve`, subprocesses) of the tiny random checkpoint on the CPU. Load: --images
new images; each is sent to both replicas at once (one encode on each, HTTP on one and gRPC on the other,
no wait), --concurrency images at a time; then every image is fetched from both replicas and the rows
compared (they must be equal: one encode). Writes benchmarks/results/replica_race-<date>-<commit>.json.

    .venv/bin/python -m benchmarks.replica_race --images 400 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.report import stamp, write_result
from encoder_service.client import AsyncEncoderClient
from tests.support.encoder_process import Replica
from tests.support.images import image_bytes, png_with_text
from tests.support.redis_server import RedisServer

COUNTERS = ("encoder_images_encoded_total", "encoder_cache_redis_claimed_elsewhere_total",
            "encoder_cache_redis_pending_waits_total", "encoder_requests_total")


async def race(replicas: list[Replica], images: int, concurrency: int) -> dict:
    base = image_bytes(160, 120, seed=0)
    a = AsyncEncoderClient.http(replicas[0].url, timeout=60)
    b = AsyncEncoderClient.grpc(replicas[1].grpc_address, timeout=60)
    slots = asyncio.Semaphore(concurrency)
    wrong = errors = 0

    async def one(n: int) -> None:
        nonlocal wrong, errors
        data = png_with_text(base, n)
        async with slots:
            try:
                (on_a,), (on_b,) = await asyncio.gather(a.encode([data]), b.encode([data]))
                rows_a = (await a.fetch([(on_a.id, 0)], 0, on_a.num_tokens)).rows
                rows_b = (await b.fetch([(on_b.id, 0)], 0, on_b.num_tokens)).rows
            except Exception as exc:  # noqa: BLE001 - counted, reported
                errors += 1
                print(f"image {n}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return
            wrong += on_a.id != on_b.id or not torch.equal(rows_a, rows_b)

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(n) for n in range(images)))
    finally:
        await a.close()
        await b.close()
    return {"elapsed_s": time.monotonic() - t0, "wrong_rows": wrong, "errors": errors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--family", default="qwen2_5_vl")
    args = p.parse_args()

    from encoder_service.testing.tiny import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="race-"))
    checkpoint = build_tiny_checkpoint(args.family, work / args.family)
    redis = RedisServer(maxmemory="512mb", policy="allkeys-lru").start()
    replicas = [Replica(name, checkpoint, redis.url, work, python=sys.executable) for name in ("a", "b")]
    try:
        for r in replicas:
            r.wait_ready(180)
        before = [r.metrics(COUNTERS) for r in replicas]
        outcome = asyncio.run(race(replicas, args.images, args.concurrency))
        after = [r.metrics(COUNTERS) for r in replicas]
    finally:
        for r in replicas:
            r.stop()
        redis.stop()
    delta = {name: sum(x.get(name, 0) - y.get(name, 0) for x, y in zip(after, before)) for name in COUNTERS}
    per_image = delta["encoder_images_encoded_total"] / args.images
    setup = stamp() | {
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, Python {sys.version.split()[0]}",
        "model": f"tiny random {args.family} (encoder_service/testing/tiny.py), CPU, float32",
        "replicas": "2 (subprocesses), one redis-server (allkeys-lru)",
        "load": f"{args.images} new images, each sent to both replicas at once, {args.concurrency} at a time",
    }
    lines = ["| setup | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in setup.items()]
    lines += ["", "| distinct images | encodes (both replicas) | encodes per image | claimed elsewhere (waited) | "
                  "wrong rows | errors | seconds |", "|---|---|---|---|---|---|---|",
              f"| {args.images} | {delta['encoder_images_encoded_total']:.0f} | {per_image:.3f} | "
              f"{delta['encoder_cache_redis_claimed_elsewhere_total']:.0f} | {outcome['wrong_rows']} | "
              f"{outcome['errors']} | {outcome['elapsed_s']:.1f} |"]
    text = "\n".join(lines)
    print(text)
    write_result("replica_race", setup, {"images": args.images, "encodes_per_image": per_image,
                                         "counters": delta, **outcome}, text + "\n")
    if outcome["wrong_rows"] or outcome["errors"]:
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
