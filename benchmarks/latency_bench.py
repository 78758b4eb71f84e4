"""One image at a time through the service (issue 40, item 1): where a request's time goes, per stage, by the
service's own timings, next to the ViT graph alone.

The Qwen2.5-VL-7B (or --family qwen3_vl, Qwen3-VL-8B) vision tower at its real size, random weights, bf16, the
service's defaults (CUDA graphs, --preprocess torchvision on CUDA), served as a user serves it: an
`encoder-service serve` process on 127.0.0.1 (tests/support/encoder_process.py), so that the client here shares no
interpreter with it; --small: a tiny tower of the same structure on the CPU.
Per size (720p and 1080p photo-like JPEGs, each request's its own: no cache hits), after WARMUP requests,
--requests requests one after another (concurrency 1): `POST /v1/encode?wait=true` with the JPEG as the body,
the answer's `timings` (the x-timing-* headers' values) and the client's wall time. Stages, median ms:

  read            the request's body to bytes                                      timings.read_ms
  probe           the header read and the content hash (the service's "decode_ms") timings.decode_ms
  preprocess      decode, resize, normalize, patchify (a CPU thread)               timings.preprocess_ms
  queue wait      submit to its batch's launch, less the preprocess (the engine queues an image when it is
                  submitted, its prepare running meanwhile)                       queue_ms - preprocess_ms
  ViT + rows out  the batch's launch to its rows on the host (ViT, copy to host and to the device row arena)
                                                                                   timings.encode_ms
  rest of the core  admission, store, flight                     total_ms - read - probe - queue - encode
  answer          the HTTP request and answer around the core (client wall - total_ms)

and beside them the ViT graph alone on the same images at batch 1 (benchmarks/common/model_alone.py: the
service's runner built by its own build_core in this process, without a device row arena, measured, then its
memory released to the driver before the service starts; this process keeps its CUDA context). The
service does not time decode, resize and the host-to-device copy apart (all in preprocess), nor the ViT apart
from its rows' copies (all in encode): the report says so.

    python -m benchmarks.latency_bench                   # GPU (a minute or two)
    python -m benchmarks.latency_bench --small           # CPU smoke test (benchmarks/tests/test_latency_bench.py)

Writes benchmarks/results/latency_bench-<date>-<commit>.json and $OUT/latency_bench.md
(benchmarks/common/report.py). Exits 1 when a request fails or is answered from the cache.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.common.device import bench_device
from benchmarks.common.images import make_jpegs
from benchmarks.common.model_alone import engine_inputs, model_alone, reference_text
from benchmarks.common.models import NAMES, build_checkpoint
from benchmarks.common.report import setup_info, write_result
from benchmarks.common.service import service_settings
from benchmarks.common.stats import percentile
from tests.support.encoder_process import Replica

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}
WARMUP = 3
STAGES = ("read", "probe", "preprocess", "queue wait", "ViT + rows out", "rest of the core", "answer")


def stages(timings: dict, wall_ms: float) -> dict[str, float]:
    """One answer's stages (ms) from its timings and the client's wall time."""
    t = timings
    queue = t["queue_ms"] - t["preprocess_ms"]
    rest = t["total_ms"] - t["read_ms"] - t["decode_ms"] - t["queue_ms"] - t["encode_ms"]
    return {"read": t["read_ms"], "probe": t["decode_ms"], "preprocess": t["preprocess_ms"], "queue wait": queue,
            "ViT + rows out": t["encode_ms"], "rest of the core": rest, "answer": wall_ms - t["total_ms"],
            "client wall": wall_ms}


def one_at_a_time(url: str, images: list[bytes], warmup: int) -> tuple[list[dict], list[str]]:
    """Each image's stages (after `warmup` untimed), and what went wrong."""
    rows, checks = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for k, data in enumerate(images):
            t0 = time.perf_counter()
            answer = client.post("/v1/encode", params={"wait": "true"}, content=data,
                                 headers={"content-type": "image/jpeg"})
            wall_ms = (time.perf_counter() - t0) * 1e3
            if answer.status_code != 200:
                checks.append(f"request {k}: HTTP {answer.status_code}: {answer.text[:200]}")
                continue
            body = answer.json()
            if body["images"][0]["cached"]:
                checks.append(f"request {k}: answered from the cache (its image was meant to be new)")
            if k >= warmup:
                rows.append(stages(body["timings"], wall_ms))
            # Untimed: its pin goes (a 67 MB Qwen3-VL 1080p entry each: 32 of them fill the default pins).
            client.post("/v1/release", json={"ids": [body["images"][0]["id"]]}).raise_for_status()
    return rows, checks


def medians(rows: list[dict]) -> dict[str, float]:
    return {name: percentile([r[name] for r in rows], 50) for name in (*STAGES, "client wall")}


def markdown(setup: dict, result: dict, checks: list[str]) -> str:
    sizes = list(result["sizes"])
    lines = ["# One image at a time: the service's stages (issue 40, item 1)", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()), "",
             "Median ms per request, concurrency 1, the service's own timings (benchmarks/latency_bench.py's "
             "docstring: what each stage is).", "",
             "| stage | " + " | ".join(sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for name in (*STAGES, "client wall"):
        lines.append(f"| {name} | " + " | ".join(f"{result['sizes'][s]['median_ms'][name]:.2f}" for s in sizes) + " |")
    lines.append("| ViT graph alone, batch 1 | " + " | ".join(
        f"{result['sizes'][s]['vit_alone']['rows'][0]['ms']:.2f}" for s in sizes) + " |")
    lines += ["", "ViT graph alone: " + "; ".join(f"{s}: {reference_text(result['sizes'][s]['vit_alone'])}"
                                                   for s in sizes), "",
              "Not split by the service: decode, resize/normalize/patchify and the host-to-device copy are one "
              "stage (preprocess); the ViT and its rows' copies to the host and the device row arena are one "
              "(ViT + rows out).", "", "Checks: " + ("all passed" if not checks else "; ".join(checks))]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a tiny tower on the CPU, a few requests")
    parser.add_argument("--family", default=FAMILIES[0], choices=FAMILIES,
                        help="the vision tower (default %(default)s)")
    parser.add_argument("--requests", type=int, help="timed requests per size (default 30; --small 2)")
    parser.add_argument("--preprocess", help="the service's --preprocess (default: its own, torchvision on CUDA)")
    args = parser.parse_args()
    requests = args.requests or (2 if args.small else 30)

    from encoder_service.api.service import bind_socket, build_core

    device, dtype = bench_device(args.small, parser)
    flags = ("--preprocess", args.preprocess) if args.preprocess else ()
    checks, result = [], dict(sizes={})
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        checkpoint.mkdir()
        build_checkpoint(args.family, args.small, device, dtype, checkpoint)
        with bind_socket("127.0.0.1", 0) as unused_sock:  # (the settings want a port; the core serves none)
            # No device row arena: the ViT alone needs none, and its raw allocation would outlive `del core`.
            core = build_core(service_settings(checkpoint, device, dtype, unused_sock, *flags,
                                               "--ipc-arena-bytes", "0", grpc=False))
        setup = setup_info(device, dtype, args.small) | dict(
            model=f"tiny {args.family}" if args.small else f"{NAMES[args.family]} vision tower", requests=requests,
            runner=core.runner.describe()["runner"], preprocess=core.metadata().get("preprocess"),
            served_by="an encoder-service serve process")
        images = {}
        for k, (name, size) in enumerate(SIZES.items()):
            images[name] = make_jpegs(size, range(1_000_000 * (k + 1), 1_000_000 * (k + 1) + WARMUP + requests))
            pvs, grids = engine_inputs(core, images[name][:1])
            result["sizes"][name] = dict(vit_alone=model_alone(core.runner, pvs, grids, device, batches=(1,),
                                                               seconds=0.5 if args.small else 2.0, max_calls=200))
        del core, pvs  # the runner's graphs and buffers go back before the service process starts
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with Replica("latency", checkpoint, None, Path(tmp), "--dtype", str(dtype).removeprefix("torch."), *flags,
                     device=device.type, python=sys.executable) as service:
            service.wait_ready(timeout_s=1800)  # CUDA graph capture
            for name in SIZES:
                rows, failed = one_at_a_time(service.url, images[name], WARMUP)
                checks += [f"{name} {c}" for c in failed]
                result["sizes"][name] |= dict(median_ms=medians(rows), requests=rows)
    report = markdown(setup, result, checks)
    write_result("latency_bench", setup, result | dict(failed_checks=checks), report)
    print(report)
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
