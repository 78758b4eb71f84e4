"""End-to-end scenarios against an in-process service (core + HTTP on loopback) with a real-size
random-weight tower.

multi-turn: a conversation of 8 rounds, each adding one 1920x1080 image. Per round the LLM server sends
  every image of the conversation again (the cache answers the old ones) and fetches all their rows in
  prefill chunks. Reported per round: the encode request (wait=True: until the new image's rows exist),
  the fetch of all rows, and the same two with every image re-encoded (the same pixels with different
  bytes, so no cache hit: what a server without an embedding cache pays each round).
many-images: one request with 64 images of 2560x1440 completes (encode wait=True, then every row
  fetched); peak GPU memory of the whole request is reported next to the peak for 8 images of the same
  size: the ViT runs batch by batch within --batch-tokens, so the peak follows the batch budget (or the
  largest single image when one image is over the budget), not the image count.

    python -m benchmarks.scenarios                         # GPU: Qwen2.5-VL-7B tower, bfloat16
    python -m benchmarks.scenarios --family qwen3_vl       # GPU: Qwen3-VL-8B tower (deepstack rows)
    python -m benchmarks.scenarios --small                 # CPU: tiny tower, small images (smoke test)
    python -m benchmarks.scenarios --shm                   # fetches through shared memory, not the socket

Prints one markdown table per scenario and writes benchmarks/results/scenarios-<date>-<commit>.json and
$OUT/scenarios.md (benchmarks/common/report.py: where, with and without OUT). Exits 1 if a check fails (row
counts, or the many-images peak growing with the image count).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.device import bench_device, sync
from benchmarks.common.images import jpeg
from benchmarks.common.models import REAL, SMALL, build_checkpoint
from benchmarks.common.report import setup_info, write_result
from benchmarks.common.service import in_process_service, service_settings
from encoder_service.api.service import bind_socket
from encoder_service.client import EncoderClient

# Peak memory for 64 images may exceed the 8-image peak by this factor and still count as "bounded".
PEAK_GROWTH_LIMIT = 1.25


def fetch_all(client: EncoderClient, infos, chunk_size: int) -> int:
    """Fetch every row of `infos` laid out back to back (one text token between images) in prefill chunks;
    returns the number of rows received."""
    items, pos = [], 0
    for info in infos:
        pos += 1  # <|vision_start|>
        items.append((info.id, pos, info.num_tokens))
        pos += info.num_tokens + 1  # placeholders, <|vision_end|>
    rows = 0
    for chunk in client.iter_chunks((items, pos), chunk_size):
        rows += 0 if chunk.rows is None else int(chunk.rows.shape[0])
    return rows


def multi_turn(client: EncoderClient, device, rounds: int, size: tuple[int, int], chunk_size: int) -> list[dict]:
    images = [jpeg(*size, seed=i) for i in range(rounds)]
    results = []
    for r in range(1, rounds + 1):
        # Cached path: the conversation so far, as bytes already seen (all but the newest image hit).
        t0 = time.perf_counter()
        infos = client.encode(images[:r], wait=True)
        t1 = time.perf_counter()
        rows = fetch_all(client, infos, chunk_size)
        t2 = time.perf_counter()
        # Baseline: every image re-encoded (same pixels, new bytes -> cache miss), then the same fetch.
        fresh = [jpeg(*size, seed=i, comment=f"round {r}") for i in range(r)]
        sync(device)
        t3 = time.perf_counter()
        fresh_infos = client.encode(fresh, wait=True)
        t4 = time.perf_counter()
        fresh_rows = fetch_all(client, fresh_infos, chunk_size)
        t5 = time.perf_counter()
        tokens = sum(i.num_tokens for i in infos)
        ok = rows == tokens == fresh_rows and sum(i.cached for i in infos) == r - 1
        results.append(dict(round=r, images=r, tokens=tokens, new_image_tokens=infos[-1].num_tokens,
                            encode_ms=(t1 - t0) * 1e3, fetch_ms=(t2 - t1) * 1e3, encode_fetch_ms=(t2 - t0) * 1e3,
                            reencode_ms=(t4 - t3) * 1e3, reencode_fetch_ms=(t5 - t3) * 1e3,
                            speedup=(t5 - t3) / (t2 - t0), cached_hits=sum(i.cached for i in infos), ok=ok))
        print(f"multi-turn round {r}: {results[-1]}")
    return results


def many_images(client: EncoderClient, device, counts: list[int], size: tuple[int, int], chunk_size: int,
                batch_tokens: int) -> list[dict]:
    results = []
    for count in counts:
        images = [jpeg(*size, seed=1000 * count + i) for i in range(count)]  # fresh bytes per run: no hits
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        infos = client.encode(images, wait=True)
        t1 = time.perf_counter()
        rows = fetch_all(client, infos, chunk_size)
        t2 = time.perf_counter()
        peak = None
        if device.type == "cuda":
            sync(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        tokens = sum(i.num_tokens for i in infos)
        patches = [i.grid_thw[0] * i.grid_thw[1] * i.grid_thw[2] for i in infos]
        results.append(dict(images=count, size=f"{size[0]}x{size[1]}", tokens=tokens, patches_per_image=patches[0],
                            batch_tokens=batch_tokens, encode_ms=(t1 - t0) * 1e3, fetch_ms=(t2 - t1) * 1e3,
                            peak_gpu_mib=None if peak is None else peak / 2**20, ok=rows == tokens))
        print(f"many-images {count}: {results[-1]}")
    return results


def markdown(setup: dict, turns: list[dict], many: list[dict], checks: list[str]) -> str:
    lines = ["# Scenarios (in-process service, HTTP on loopback)", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()), "", "## multi-turn: one new image per round", "",
             "| round | images | tokens | encode ms (new image, rest cached) | fetch ms | encode+fetch ms "
             "| re-encode all ms | re-encode all + fetch ms | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {t['round']} | {t['images']} | {t['tokens']} | {t['encode_ms']:.1f} | {t['fetch_ms']:.1f} "
              f"| {t['encode_fetch_ms']:.1f} | {t['reencode_ms']:.1f} | {t['reencode_fetch_ms']:.1f} "
              f"| {t['speedup']:.2f}x |" for t in turns]
    lines += ["", "## many-images: one request", "",
              "| images | size | tokens | patches/image | batch budget (patches) | encode ms | fetch ms "
              "| peak GPU MiB |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m['images']} | {m['size']} | {m['tokens']} | {m['patches_per_image']} | {m['batch_tokens']} "
              f"| {m['encode_ms']:.0f} | {m['fetch_ms']:.0f} "
              f"| {'n/a (cpu)' if m['peak_gpu_mib'] is None else format(m['peak_gpu_mib'], '.0f')} |" for m in many]
    lines += ["", "Checks: " + ("all passed" if not checks else "; ".join(checks))]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(REAL), default="qwen2_5_vl")
    parser.add_argument("--small", action="store_true", help="tiny tower, float32, CPU, small images")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--many", type=int, default=64, help="images in the many-images request")
    parser.add_argument("--chunk-size", type=int, default=8192, help="prefill chunk (tokens) of the fetches")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="the service's --batch-tokens")
    parser.add_argument("--shm", action="store_true",
                        help="fetch through shared memory (server --shm-fetch, client shm=True) instead of HTTP")
    args = parser.parse_args()
    device, dtype = bench_device(args.small, parser)
    turn_size, many_size = ((320, 180), (256, 144)) if args.small else ((1920, 1080), (2560, 1440))

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp)
        build_checkpoint(args.family, args.small, device, dtype, checkpoint)
        http_sock = bind_socket("127.0.0.1", 0)  # HTTP only (gRPC off), on a free loopback port
        settings = service_settings(
            checkpoint, device, dtype, http_sock, "--batch-tokens", str(args.batch_tokens),
            "--max-images", str(max(64, args.many)), "--max-body-bytes", "1GiB", "--max-image-bytes", "64MiB",
            "--max-queue", str(max(256, 2 * args.many)), "--cache-bytes", "48GiB" if not args.small else "2GiB",
            *(["--shm-fetch"] if args.shm else []), grpc=False)
        setup = setup_info(device, dtype, args.small) | dict(
            family=args.family, vision=json.dumps((SMALL if args.small else REAL)[args.family]),
            chunk_size=args.chunk_size, batch_tokens=args.batch_tokens, fetch="shared memory" if args.shm else "HTTP",
            cuda_graphs=settings.engine.cuda_graphs)
        print(json.dumps(setup))
        svc = in_process_service(settings, http_sock)
        try:
            with EncoderClient.http(svc.url, timeout=600, shm=args.shm) as client:
                turns = multi_turn(client, device, args.rounds, turn_size, args.chunk_size)
                counts = sorted({min(8, args.many), args.many})
                many = many_images(client, device, counts, many_size, args.chunk_size, args.batch_tokens)
        finally:
            svc.close()

    checks = [f"multi-turn round {t['round']}: rows or cache hits wrong" for t in turns if not t["ok"]]
    checks += [f"many-images {m['images']}: rows missing" for m in many if not m["ok"]]
    peaks = [m["peak_gpu_mib"] for m in many if m["peak_gpu_mib"] is not None]
    if len(peaks) == 2 and peaks[1] > PEAK_GROWTH_LIMIT * peaks[0]:
        checks.append(f"peak GPU memory grew with the image count: {peaks[0]:.0f} -> {peaks[1]:.0f} MiB")
    if turns:
        later = turns[1:] or turns  # round 1 has nothing cached
        setup["median_speedup_rounds_2_plus"] = round(statistics.median(t["speedup"] for t in later), 2)

    report = markdown(setup, turns, many, checks)
    write_result("scenarios", setup, dict(multi_turn=turns, many_images=many, failed_checks=checks), report)
    print(report)
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
