"""Clients that disconnect while they wait: does the replica drop their work (issue 22 item 3)?

One replica (`python -m encoder_service.cli serve`, a subprocess) of the tiny random checkpoint on the CPU,
no Redis. Four phases of --requests encodes each (new images, `wait=true`), --concurrency at a time over HTTP:
  complete     every client waits for its answer;
  disconnect   every client closes its connection after --after-ms (while its image waits or encodes);
then both again (memory that keeps growing with each disconnect phase would be a leak).
Per phase: the answers by status (429s: the queue full of work nobody waits for), the images the ViT encoded,
the replica's RSS at the end, and how long until its queue is empty after the last client left. A replica
that drops abandoned work at once encodes few of the disconnect phase's images, answers no 429, and its RSS
and queue stay as in the complete phase. Writes benchmarks/results/disconnects-<date>-<commit>.json.

    .venv/bin/python -m benchmarks.disconnects --requests 1000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.common.report import stamp, write_result
from benchmarks.common.stats import rss_mib
from tests.support.encoder_process import Replica
from tests.support.images import image_bytes, png_with_text

ENCODED, QUEUE = "encoder_images_encoded_total", "encoder_queue_depth"


async def phase(replica: Replica, base: bytes, first: int, args, disconnect: bool) -> dict:
    statuses: collections.Counter = collections.Counter()
    slots = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=replica.url, timeout=120, limits=limits) as client:
        async def one(n: int) -> None:
            async with slots:
                call = client.post("/v1/encode", params={"wait": "true"}, content=png_with_text(base, n),
                                   headers={"content-type": "image/png"})
                try:
                    response = await (asyncio.wait_for(call, args.after_ms / 1e3) if disconnect else call)
                    statuses[str(response.status_code)] += 1
                except asyncio.TimeoutError:
                    statuses["left"] += 1  # the connection closed while the server worked on it

        encoded = replica.metrics((ENCODED,)).get(ENCODED, 0)
        t0 = time.monotonic()
        await asyncio.gather(*(one(n) for n in range(first, first + args.requests)))
        left_at = time.monotonic()
    while replica.metrics((QUEUE,)).get(QUEUE, 0) > 0 and time.monotonic() - left_at < 120:
        await asyncio.sleep(0.05)
    drained_s = time.monotonic() - left_at
    return {"statuses": dict(statuses), "encoded": replica.metrics((ENCODED,)).get(ENCODED, 0) - encoded,
            "seconds": left_at - t0, "queue_empty_after_s": drained_s, "rss_mib": rss_mib(replica.proc.pid)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--after-ms", type=float, default=20.0)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--family", default="qwen2_5_vl")
    args = p.parse_args()

    from encoder_service.testing.tiny import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="disconnects-"))
    checkpoint = build_tiny_checkpoint(args.family, work / args.family)
    replica = Replica("a", checkpoint, None, work, "--max-queue", str(args.max_queue), python=sys.executable)
    base = image_bytes(640, 480, seed=0)
    try:
        replica.wait_ready(180)
        start_rss = rss_mib(replica.proc.pid)
        phases = {}
        for k, name in enumerate(("complete", "disconnect", "disconnect again", "complete again")):
            phases[name] = asyncio.run(phase(replica, base, k * args.requests, args,
                                             disconnect=name.startswith("disconnect")))
    finally:
        replica.stop()
    setup = stamp() | {
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, Python {sys.version.split()[0]}",
        "model": f"tiny random {args.family} (encoder_service/testing/tiny.py), CPU, float32",
        "replica": f"1 (subprocess), --max-queue {args.max_queue}, no Redis; RSS at start {start_rss:.0f} MiB",
        "load": f"{args.requests} new 640x480 PNGs per phase, wait=true, {args.concurrency} at a time over HTTP; "
                f"disconnect phase: each client leaves after {args.after_ms:g} ms",
    }
    lines = ["| setup | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in setup.items()]
    lines += ["", "| phase | answers | images encoded | seconds | queue empty after (s) | RSS at end (MiB) |",
              "|---|---|---|---|---|---|"]
    for name, r in phases.items():
        answers = ", ".join(f"{s}: {n}" for s, n in sorted(r["statuses"].items()))
        lines.append(f"| {name} | {answers} | {r['encoded']:.0f} | {r['seconds']:.1f} | "
                     f"{r['queue_empty_after_s']:.2f} | {r['rss_mib']:.0f} |")
    text = "\n".join(lines)
    print(text)
    write_result("disconnects", setup, {"phases": phases, "start_rss_mib": start_rss}, text + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
