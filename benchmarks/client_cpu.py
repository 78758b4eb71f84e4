"""The async client's own CPU per image (issue 40 item 3), on the CPU: one `encoder-service serve` process (tiny
Qwen2.5-VL, its device row arena on the host stand-in: tests/support/standin_serve.py) and, in another process,
one AsyncEncoderClient at concurrency C running, per image (each request a new image): encode wait=true, its rows
into the worker's reused `out` by IPC, release. Four ways, each its own run:

  fetch/channel, fetch/http   two requests: encode, then fetch(out=...) by IPC, over the channel / over HTTP
  hold/channel, hold/http     one request: encode(out=...), the encode's answer carrying the hold (the two
                              only differ when a row is not placed: then fetched over the one or the other)
(over HTTP: a second server with --ipc-channel off).

Measured in the client's process (the server's CPU is not in it): CPU seconds (process_time: the event loop and
the client's threads) per image, in microseconds, and images/s (the server, on the shared CPU, bounds that).
`--profile`: cProfile of the client's event loop thread per way, its top functions by own time written to
$OUT/client_cpu-<way>.txt (the way's / as -: client_cpu-fetch-channel.txt).

    python -m benchmarks.client_cpu [--images 400] [--concurrency 16] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# way -> (flow, the server's channel): "fetch": encode, then fetch by IPC; "hold": encode(out=...), one request
WAYS = {"fetch/channel": ("fetch", "on"), "fetch/http": ("fetch", "off"), "hold/channel": ("encode", "on"),
        "hold/http": ("encode", "off")}


def images(n: int, seed: int) -> list[bytes]:
    """n distinct small PNGs (a 56x56 image: 4 rows, so the client's per-request work dominates)."""
    from PIL import Image

    out = []
    for k in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (56, 56), ((seed + k) % 256, (seed + k) // 256 % 256, 7)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


async def closed_loop(url: str, standin: str, flow: str, datas: list[bytes], concurrency: int) -> dict:
    """`concurrency` workers, each the flow for the next image until `datas` runs out; the client's CPU."""
    import torch

    from encoder_service.client import AsyncEncoderClient
    from encoder_service.testing.host_ipc import HostStandInReader

    async with AsyncEncoderClient.http(url, timeout=60, ipc=HostStandInReader(standin)) as client:
        await client.metadata()
        queue = iter(datas)

        async def worker() -> None:
            out = None
            for data in queue:
                if flow == "fetch":
                    (info,) = await client.encode([data], wait=True)
                    if out is None:
                        out = torch.empty(info.num_tokens, info.row_width, dtype=getattr(torch, info.dtype))
                    await client.fetch([(info.id, 0)], 0, info.num_tokens, out=out[:info.num_tokens])
                else:
                    def dest(info):
                        nonlocal out
                        if out is None:
                            out = torch.empty(info.num_tokens, info.row_width, dtype=getattr(torch, info.dtype))
                        return out[:info.num_tokens]

                    (info,) = await client.encode([data], out=dest)
                await client.release([info.id])

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        return dict(paths=dict(client.fetch_paths), cpu_s=cpu, wall_s=wall)


def client_main(job: dict) -> dict:
    """One way, in this (client) process: its numbers, and with `profile` cProfile's top functions."""
    datas = images(job["images"] + 8, job["seed"])
    warm, timed = datas[:8], datas[8:]

    async def run() -> dict:
        await closed_loop(job["url"], job["standin"], job["flow"], warm, 2)
        profiler = cProfile.Profile() if job["profile"] else None
        if profiler is not None:
            profiler.enable()
        try:
            return await closed_loop(job["url"], job["standin"], job["flow"], timed, job["concurrency"])
        finally:
            if profiler is not None:
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
                Path(job["profile"]).write_text(text.getvalue())

    got = asyncio.run(run())
    n = job["images"]
    return dict(got, us_per_image=1e6 * got["cpu_s"] / n, images_per_s=n / got["wall_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="cProfile each way's client loop ($OUT)")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated: " + ", ".join(WAYS))
    parser.add_argument("--client", metavar="JOB_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(client_main(json.loads(Path(args.client).read_text()))))
        return 0

    from benchmarks.common.report import ROOT, out_dir, setup_info, write_result
    from encoder_service.testing.tiny import build_tiny_checkpoint
    from tests.support.encoder_process import Replica, standin_entry, started

    out = out_dir()
    rows, checks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_checkpoint("qwen2_5_vl", Path(tmp) / "ckpt")
        servers = {channel: Replica(f"channel-{channel}", checkpoint, None, Path(tmp), "--ipc-arena-bytes", "64MiB",
                                    "--ipc-channel", "auto" if channel == "on" else "off",
                                    entry=standin_entry(Path(tmp)))
                   for channel in ("on", "off")}
        with started(*servers.values()):
            for k, way in enumerate(w for w in args.ways.split(",") if w):
                flow, channel = WAYS[way]
                job = Path(tmp) / f"job{k}.json"
                profile = str(out / f"client_cpu-{way.replace('/', '-')}.txt") if args.profile else None
                job.write_text(json.dumps(dict(url=servers[channel].url, standin=tmp, flow=flow, images=args.images,
                                               concurrency=args.concurrency, seed=1000 * (k + 1), profile=profile)))
                done = subprocess.run([sys.executable, "-m", "benchmarks.client_cpu", "--client", str(job)],
                                      cwd=ROOT, capture_output=True, text=True, timeout=600)
                if done.returncode:
                    checks.append(f"{way}: the client failed: {done.stderr[-1500:]}")
                    continue
                got = json.loads(done.stdout.strip().splitlines()[-1])
                if got["paths"] != {"ipc": args.images}:
                    checks.append(f"{way}: rows went {got['paths']}, not all by IPC")
                rows.append(dict(way=way, profile=profile, **got))
                print(f"{way}: {got['us_per_image']:.0f} us/image, {got['images_per_s']:.0f} images/s", flush=True)
    setup = setup_info(__import__("torch").device("cpu"), None, True) | dict(
        images=args.images, concurrency=args.concurrency, cpu_count=os.cpu_count())
    lines = ["# The async client's CPU per image (encode, rows by IPC into `out`, release)", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()), "",
             "| way | client CPU us / image | images/s | rows by | profile |", "|---|---|---|---|---|"]
    lines += [f"| {r['way']} | {r['us_per_image']:.0f} | {r['images_per_s']:.0f} | {r['paths']} "
              f"| {Path(r['profile']).name if r['profile'] else ''} |" for r in rows]
    lines.append("\nChecks: " + ("all passed" if not checks else "; ".join(checks)))
    report = "\n".join(lines) + "\n"
    write_result("client_cpu", setup, dict(rows=rows, checks=checks), report)
    print(report)
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
