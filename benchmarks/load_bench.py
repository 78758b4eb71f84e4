"""Load benchmark of the running service (issue 5, item 7; issue 20): uvicorn + grpc.aio on 127.0.0.1, this process.

Model: the Qwen2.5-VL-7B (or, --family qwen3_vl, Qwen3-VL-8B) vision tower at its real size, random weights,
bfloat16, CUDA graphs on (the service's default buckets), saved to a temp dir and loaded by our loader (the
service's own build_core).

  1. the model alone (benchmarks/common/model_alone.py): the service's runner (`runner.encode`, synchronized)
     on 720p images preprocessed as the engine does, their pixel values on the device, in batches of 1, 4, 8,
     16 and 32 images as its plan runs them (graphs); images/s. The best batch is the reference of the
     target (every "% of model alone" below). Beside each batch, diagnostics: the same with each output
     copied to the host, and the eager route (one tower forward for the whole batch).
  2. encode under load: distinct 720p JPEGs (distinct pixels and bytes per request: no cache hits), one
     image per HTTP request (`POST /v1/encode?wait=true`, AsyncEncoderClient, a keep-alive connection
     per worker; with --flow e2e each request also fetches all of its image's rows into a preallocated
     tensor and releases the id, as an LLM server does; --flow e2e-norelease the same without the release,
     as a client that never calls it), closed loop at concurrency 1, 4, 16, 64 (spread over --clients
     load-generator processes), each level bounded in requests and seconds (with --duration-s, in seconds
     only: every request sends other bytes, one of a few JPEGs with the request's number in a comment);
     images/s, p50/p99 latency, and from the service's /metrics over the level: mean images per ViT batch,
     mean time from a batch's launch to its rows on the host (batches overlap: the engine launches the next
     one while the previous one's rows are copied), mean preprocess and queue ms. Target: the best level
     reaches >= 90% of (1).
  3. fetch of one cached 1080p entry, all its rows (19 MB in bf16), sequential, p50/p99 ms, EncoderClient with
     `out=` a preallocated buffer: over the HTTP and the gRPC socket, and through shared memory (client and
     server on one host; the server writes into the client's file: into `out` itself when it comes from
     `alloc_rows`, else into a staging file the client copies out of). Target: p50 <= 3 ms on loopback.

The load generator runs in child processes (this script with --client; --clients of them, each with its
share of a level's workers and images, started together per level) so that its Python work does not share
the service's GIL and one process is not the bottleneck; the service, the model-alone runs and the children
are all started and bounded here.

    python -m benchmarks.load_bench            # GPU (H100: about 2-3 minutes)
    python -m benchmarks.load_bench --family qwen3_vl --flow e2e --levels 64 --clients 4   # issue 20's end to end
    python -m benchmarks.load_bench --flow e2e-norelease --levels 64 --clients 4 --duration-s 420 \
        --cache-bytes default   # issue 20's client that never releases, against the service's default cache
    python -m benchmarks.load_bench --small    # CPU: tiny checkpoint (encoder_service/testing/tiny.py), few requests
    python -m benchmarks.load_bench --attention torch   # the service's --attention (default auto); one per run
    python -m benchmarks.load_bench --preprocess pil --levels 1   # the service's --preprocess; only these levels
    python -m benchmarks.load_bench --family qwen3_vl --levels 64  # Qwen3-VL-8B's tower instead (4x wider rows)

Prints a markdown table; writes benchmarks/results/load_bench-<date>-<commit>.json and $OUT/load_bench.md
(benchmarks/common/report.py: where, with and without OUT).
Exits 1 when a correctness check fails (request errors, cache hits on distinct images, fetched rows wrong
or HTTP/gRPC disagreeing); targets are reported (met / MISSED), not enforced.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from benchmarks.common import children
from benchmarks.common.device import bench_device
from benchmarks.common.images import make_jpegs, stamped
from benchmarks.common.load import closed_loop, scrape
from benchmarks.common.model_alone import BATCHES, SMALL_BATCHES, reference_text
from benchmarks.common.models import NAMES, REAL, build_checkpoint
from benchmarks.common.report import setup_info, write_result
from benchmarks.common.service import in_process_service, service_settings
from benchmarks.common.stats import percentile

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
LEVELS = (1, 4, 16, 64)
# encode wait=true; e2e: encode wait=true, fetch all rows, release; e2e-norelease: the same without the release
FLOWS = ("encode", "e2e", "e2e-norelease")
ENCODE_SIZE, FETCH_SIZE = (1280, 720), (1920, 1080)
SERVICE_TARGET = 0.90  # service images/s >= 90% of the model alone
FETCH_TARGET_MS = 3.0  # p50 of a whole cached 1080p entry on loopback
# Per mode: requests per level (a level also stops starting requests after level_s), warm-up requests,
# fetch iterations (and seconds) per transport, seconds (and at most calls) per model-alone batch size and the
# batch sizes, the child's limit.
CONFIGS = {
    "full": dict(requests={1: 48, 4: 96, 16: 192, 64: 320}, level_s=30.0, warmup=8, fetch_iters=100, fetch_s=10.0,
                 model_s=2.0, model_iters=200, model_batches=BATCHES, request_timeout_s=60.0, client_limit_s=300.0,
                 cache_bytes="24GiB"),
    "small": dict(requests={1: 4, 4: 8, 16: 16, 64: 64}, level_s=20.0, warmup=2, fetch_iters=10, fetch_s=5.0,
                  model_s=0.5, model_iters=20, model_batches=SMALL_BATCHES, request_timeout_s=60.0,
                  client_limit_s=240.0, cache_bytes="2GiB"),
}
# Image index ranges (each image's content is a function of its index): never shared between phases.
MODEL_ALONE_BASE, WARMUP_BASE, LEVEL_BASE, FETCH_BASE = 1_000_000, 2_000_000, 3_000_000, 4_000_000
STAMPED_BASES = 8  # with --duration-s: JPEGs per level and load generator that every request's bytes come from


# ---- load generator (child process) -----------------------------------------------------------------------
def server_side(before: dict, after: dict, wall_s: float) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    batches = d.get("encoder_encode_seconds_count", 0.0)
    images = d.get("encoder_images_encoded_total", 0.0)

    def mean(name, scale=1.0):
        n = d.get(f"{name}_count", 0.0)
        return scale * d.get(f"{name}_sum", 0.0) / n if n else None

    return dict(vit_batches=int(batches), vit_images=int(images),
                images_per_batch=images / batches if batches else None,
                patches_per_batch=mean("encoder_batch_patches"), vit_ms_per_batch=mean("encoder_encode_seconds", 1e3),
                preprocess_ms=mean("encoder_preprocess_seconds", 1e3), queue_ms=mean("encoder_queue_seconds", 1e3))


def merged_level(concurrency: int, parts: list[dict], before: dict, after: dict) -> dict:
    """One level's row from its load generators' raw results and the service's /metrics around it."""
    latencies = [ms for p in parts for ms in p["latencies"]]
    errors = [e for p in parts for e in p["errors"]]
    wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    done = len(latencies)
    row = dict(concurrency=concurrency, requests=done, errors=len(errors), error_samples=errors[:3],
               cache_hits=sum(p["hits"] for p in parts), num_tokens=sorted({t for p in parts for t in p["tokens"]}),
               wall_s=wall, images_per_s=done / wall if wall else 0.0, p50_ms=percentile(latencies, 50),
               p99_ms=percentile(latencies, 99), mean_ms=float(np.mean(latencies)) if latencies else float("nan"),
               time_capped=any(p["images"] is None for p in parts)
               or done + len(errors) < sum(p["images"] for p in parts), clients=len(parts))
    return row | server_side(before, after, wall)


def time_fetches(client, info, out, iters: int, budget_s: float) -> tuple[list[float], object]:
    for _ in range(3):  # warm-up: connection, first-touch of buffers
        client.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
    samples, result = [], None
    start = time.perf_counter()
    while len(samples) < iters and (len(samples) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        result = client.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples, result


# Fetch variants: (name, transport, shm, out): out "alloc" is a buffer from the client's alloc_rows (the server
# writes the rows straight into it), "tensor" a plain preallocated tensor (shm: one copy on the client).
FETCH_VARIANTS = (("http", "http", False, "tensor"), ("grpc", "grpc", False, "tensor"),
                  ("http + shm, alloc_rows out", "http", True, "alloc"),
                  ("grpc + shm, alloc_rows out", "grpc", True, "alloc"),
                  ("grpc + shm, plain tensor out", "grpc", True, "tensor"))


def fetch_bench(url: str, grpc_target: str, cfg: dict) -> tuple[list[dict], list[str]]:
    import torch

    from encoder_service.client import EncoderClient

    (data,) = make_jpegs(FETCH_SIZE, [FETCH_BASE], seed=1)
    with EncoderClient.http(url, timeout=cfg["request_timeout_s"]) as client:
        (info,) = client.encode([data], wait=True)
    dtype = getattr(torch, info.dtype)
    nbytes = info.num_tokens * info.row_width * torch.empty((), dtype=dtype).element_size()
    rows, checks, got = [], [], {}
    for name, transport, shm, out_kind in FETCH_VARIANTS:
        make = EncoderClient.http if transport == "http" else EncoderClient.grpc
        with make(url if transport == "http" else grpc_target, timeout=cfg["request_timeout_s"], shm=shm) as client:
            out = (client.alloc_rows(info.num_tokens, info.row_width, dtype) if out_kind == "alloc"
                   else torch.empty(info.num_tokens, info.row_width, dtype=dtype))
            samples, result = time_fetches(client, info, out, cfg["fetch_iters"], cfg["fetch_s"])
            got[name] = out.clone()
        served = sum(s.num_rows for s in result.segments) if result is not None else 0
        if served != info.num_tokens:
            checks.append(f"fetch over {name}: {served} rows, expected {info.num_tokens}")
        p50 = percentile(samples, 50)
        rows.append(dict(transport=name, image=f"{FETCH_SIZE[0]}x{FETCH_SIZE[1]}", rows=info.num_tokens,
                         row_width=info.row_width, dtype=info.dtype, mbytes=nbytes / 1e6, iterations=len(samples),
                         p50_ms=p50, p99_ms=percentile(samples, 99), min_ms=min(samples),
                         gb_per_s_at_p50=nbytes / (p50 * 1e-3) / 1e9))
    reference = got["http"]
    for name, rows_got in got.items():
        if not torch.equal(rows_got, reference):
            checks.append(f"fetch: {name} returned other rows than http")
    return rows, checks


def client_main(config_path: str, part: int) -> int:
    """Load generator `part` of the job's `clients`: makes its share of every level's images, says "ready",
    then per line on stdin: "level <c>" runs its share of that level and prints the raw result (JSON),
    "fetch" runs the cached-entry fetch benchmark and prints it. Ends at EOF."""
    job = json.loads(Path(config_path).read_text())
    cfg, parts = job["cfg"], job["clients"]
    counts = {int(c): n for c, n in cfg["requests"].items()}  # JSON keys are strings
    t0 = time.perf_counter()
    warm = make_jpegs(ENCODE_SIZE, range(WARMUP_BASE + part, WARMUP_BASE + cfg["warmup"], parts))
    endless = cfg.get("duration_s") is not None  # time-bounded levels: every request stamps one of a few JPEGs
    images, at = {}, LEVEL_BASE
    for c in cfg["levels"]:
        n = STAMPED_BASES * parts if endless else counts[c]
        images[c] = make_jpegs(ENCODE_SIZE, range(at + part, at + n, parts))
        at += n
    sizes = [len(b) for level in images.values() for b in level]
    print(f"client {part}: {len(sizes)} + {len(warm)} distinct {ENCODE_SIZE[0]}x{ENCODE_SIZE[1]} JPEGs "
          f"(mean {np.mean(sizes) / 1e3:.0f} kB) made in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def level(imgs, workers, count):
        return asyncio.run(closed_loop([dict(http=job["http"], grpc=job["grpc"])], imgs, workers, cfg["level_s"],
                                       cfg["request_timeout_s"], job["flow"], job["transport"], count=count))

    def stream(c: int) -> Iterable[bytes]:
        """Level c's images: its JPEGs once each, or with --duration-s without end, each request's bytes its
        own (its number in a JPEG comment: a new cache key, the same pixels and decode work)."""
        if not endless:
            return images[c]
        bases = images[c]
        return (stamped(bases[i % len(bases)], f"level {c} client {part} request {i}") for i in itertools.count())

    if warm:
        level(warm, min(4, len(warm)), len(warm))
    print(json.dumps(dict(ready=True, jpeg_kb=float(np.mean(sizes) / 1e3))), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "level":
            c = int(command[1])
            result = level(stream(c), max(1, children.share(c, part, parts)), None if endless else len(images[c]))
        else:
            try:
                fetch_rows, checks = fetch_bench(job["http"], job["grpc"], cfg)
            except Exception as exc:  # noqa: BLE001 - keep the load results, report the fetch failure
                fetch_rows, checks = [], [f"fetch benchmark failed: {type(exc).__name__}: {exc}"[:500]]
            result = dict(fetch=fetch_rows, fetch_checks=checks)
        print(json.dumps(result), flush=True)
    return 0


def drive(job_path: Path, job: dict, limit_s: float) -> dict:
    """The load generators: started together, one level at a time (each level's row merged from all of
    them, the service's /metrics scraped around it), then the cached-entry fetch from the first one."""
    procs = [children.start("benchmarks.load_bench", "--client", str(job_path), "--part", str(k))
             for k in range(job["clients"])]
    deadline = time.monotonic() + limit_s
    try:
        ready = [children.answer(proc, deadline) for proc in procs]
        levels = []
        for c in job["cfg"]["levels"]:
            before = scrape(job["http"])
            for proc in procs:
                children.tell(proc, f"level {c}")
            row = merged_level(c, [children.answer(proc, deadline) for proc in procs], before, scrape(job["http"]))
            levels.append(row)
            print("level", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                  flush=True)
        children.tell(procs[0], "fetch")
        fetched = children.answer(procs[0], deadline)
        for r in fetched["fetch"]:
            print("fetch", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}),
                  flush=True)
        return dict(levels=levels, jpeg_kb=float(np.mean([r["jpeg_kb"] for r in ready])), **fetched)
    finally:
        children.finish(procs, max(1.0, deadline - time.monotonic()))


# ---- the model alone (this process) ----------------------------------------------------------------------------
def model_alone_table(core, cfg: dict, device) -> dict:
    """The model alone on 720p images (benchmarks/common/model_alone.py: the reference of the target), and
    per batch size two diagnostics beside the runner's own route: the same with each output's copy to the
    host, and the eager route (one tower forward for the whole batch)."""
    from benchmarks.common.model_alone import engine_inputs, median_ms, model_alone

    runner = core.runner
    pvs, grids = engine_inputs(core, make_jpegs(ENCODE_SIZE, range(MODEL_ALONE_BASE, MODEL_ALONE_BASE + 4)))
    timing = dict(seconds=cfg["model_s"], max_calls=cfg["model_iters"])
    alone = model_alone(runner, pvs, grids, device, batches=cfg["model_batches"], **timing)
    eager = getattr(runner, "eager", runner)
    for row in alone["rows"]:
        b = row["batch"]
        bpvs, bgrids = [pvs[i % len(pvs)] for i in range(b)], [grids[i % len(grids)] for i in range(b)]
        for name, fn in (("d2h", lambda: [o.to("cpu") for o in runner.encode(bpvs, bgrids)]),
                         ("eager", lambda: eager.encode(bpvs, bgrids))):
            ms, _ = median_ms(fn, device, **timing)
            row[f"{name}_ms"], row[f"{name}_images_per_s"] = ms, b / (ms / 1e3)
        print("model alone", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
    return alone


# ---- report -----------------------------------------------------------------------------------------------
def _f(v, fmt=".1f", none="n/a"):
    return none if v is None or v != v else format(v, fmt)


def markdown(setup: dict, model: dict, levels: list[dict], fetch: list[dict], summary: dict,
             checks: list[str], notes: list[str]) -> str:
    ref = model["images_per_s"]
    lines = ["# Load benchmark (service on 127.0.0.1: uvicorn + grpc.aio, in process)", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()), ""]
    lines += [f"> {n}" for n in notes] + ([""] if notes else [])
    what = {"e2e": "encode wait=true, fetch of all its rows, release",
            "e2e-norelease": "encode wait=true, fetch of all its rows, never a release"}.get(setup.get("flow"),
                                                                                             "encode wait=true")
    lines += [f"## Under load: distinct {ENCODE_SIZE[0]}x{ENCODE_SIZE[1]} JPEGs, one image per request ({what}; "
              f"{setup.get('transport')} client, {setup.get('clients')} load-generator processes)", "",
              f"% of the model alone: {reference_text(model)}.", "",
              "| concurrency | requests | errors | images/s | % of model alone | p50 ms | p99 ms | images / ViT batch "
              "| launch to rows on host, ms / batch | preprocess ms | queue ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in levels:
        capped = " (time cap)" if r["time_capped"] else ""
        lines.append(f"| {r['concurrency']} | {r['requests']}{capped} | {r['errors']} | {r['images_per_s']:.1f} "
                     f"| {100 * r['images_per_s'] / ref:.0f}% | {_f(r['p50_ms'])} | {_f(r['p99_ms'])} "
                     f"| {_f(r['images_per_batch'], '.2f')} | {_f(r['vit_ms_per_batch'])} "
                     f"| {_f(r['preprocess_ms'])} | {_f(r['queue_ms'])} |")
    lines += ["", "## Model alone: runner.encode on the same images preprocessed, on the device (synchronized per "
              "batch; images/s from the median); beside it the same with each output copied to the host, and the "
              "eager route", "",
              "| batch (images) | patches | runner route | ms / batch | images/s | with D2H ms / batch "
              "| with D2H images/s | eager ms / batch | eager images/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m['batch']} | {m['patches']} | {m['route']} | {m['ms']:.2f} | {m['images_per_s']:.1f} "
              f"| {m['d2h_ms']:.2f} | {m['d2h_images_per_s']:.1f} | {m['eager_ms']:.2f} "
              f"| {m['eager_images_per_s']:.1f} |" for m in model["rows"]]
    lines += ["", "## Fetch: all rows of one cached entry, sequential requests", "",
              "| transport | image | rows x width | MB | iterations | p50 ms | p99 ms | min ms | GB/s at p50 "
              f"| target p50 <= {FETCH_TARGET_MS:g} ms |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {f['transport']} | {f['image']} | {f['rows']} x {f['row_width']} {f['dtype']} | {f['mbytes']:.1f} "
              f"| {f['iterations']} | {f['p50_ms']:.2f} | {f['p99_ms']:.2f} | {f['min_ms']:.2f} "
              f"| {f['gb_per_s_at_p50']:.1f} | {'met' if f['p50_ms'] <= FETCH_TARGET_MS else 'MISSED'} |"
              for f in fetch]
    s = summary
    lines += ["", f"Service best: {s['service_images_per_s']:.1f} images/s at concurrency {s['service_concurrency']} = "
              f"{100 * s['service_fraction']:.0f}% of the model alone, {reference_text(model)}; "
              f"target >= {100 * SERVICE_TARGET:.0f}%: {'met' if s['service_target_met'] else 'MISSED'}.",
              "", "Checks: " + ("all passed" if not checks else "; ".join(checks))]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny checkpoint, float32, CPU, few requests")
    from encoder_service.settings import ATTENTION, PREPROCESS_BACKENDS

    parser.add_argument("--attention", default="auto", choices=ATTENTION,
                        help="the service's --attention (default auto); the setup line says what ran")
    parser.add_argument("--preprocess", choices=PREPROCESS_BACKENDS,
                        help="the service's --preprocess (default: the service's own default for the device)")
    parser.add_argument("--levels", type=lambda t: tuple(int(x) for x in t.split(",")), default=LEVELS,
                        help=f"concurrency levels of the encode load (default {','.join(map(str, LEVELS))})")
    parser.add_argument("--family", default=FAMILIES[0], choices=FAMILIES,
                        help="the vision tower (default %(default)s)")
    parser.add_argument("--flow", default="encode", choices=FLOWS,
                        help="per request: encode wait=true (default), or e2e: that, a fetch of all the image's rows "
                             "and release; e2e-norelease: e2e without the release")
    parser.add_argument("--duration-s", type=float,
                        help="run each level this long, every request with other bytes (default: the mode's request "
                             "counts, 30 s at most per level)")
    parser.add_argument("--cache-bytes",
                        help="the service's --cache-bytes, or 'default' for the service's own default (default: "
                             f"{CONFIGS['full']['cache_bytes']}, --small {CONFIGS['small']['cache_bytes']})")
    parser.add_argument("--transport", default="http", choices=("http", "grpc"),
                        help="the load generators' client (default http)")
    parser.add_argument("--clients", type=int, default=1,
                        help="load-generator processes sharing each level's workers (default 1)")
    parser.add_argument("--send-threads", type=int, default=None,
                        help="the service's --send-threads (default: its default; 0: the event loop sends the rows)")
    parser.add_argument("--client", metavar="JOB_JSON", help=argparse.SUPPRESS)  # a load generator (child)
    parser.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args.client, args.part)

    from encoder_service.api.service import bind_socket, build_core

    device, dtype = bench_device(args.small, parser)
    cfg = CONFIGS["small" if args.small else "full"] | dict(levels=args.levels, duration_s=args.duration_s)
    if args.duration_s is not None:
        cfg |= dict(level_s=args.duration_s,  # every level runs its time, then its load generators end
                    client_limit_s=cfg["client_limit_s"] + len(args.levels) * (args.duration_s + 60))
    if args.cache_bytes is not None:
        cfg["cache_bytes"] = None if args.cache_bytes == "default" else args.cache_bytes
    t_start = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        checkpoint.mkdir()
        if args.small:
            from encoder_service.testing.tiny import build_tiny_checkpoint

            build_tiny_checkpoint(args.family, checkpoint)
        else:
            build_checkpoint(args.family, False, device, dtype, checkpoint)
        t_ckpt = time.perf_counter()
        http_sock = bind_socket("127.0.0.1", 0)
        settings = service_settings(
            checkpoint, device, dtype, http_sock,
            *(("--cache-bytes", cfg["cache_bytes"]) if cfg["cache_bytes"] else ()),  # room for every id encoded
            "--shm-fetch",  # the load generator is co-located: it may fetch through shared memory
            "--attention", args.attention, *(("--preprocess", args.preprocess) if args.preprocess else ()),
            *(("--send-threads", str(args.send_threads)) if args.send_threads is not None else ()))
        core = build_core(settings)  # load + CUDA graph capture, here so the model-alone runs use this runner
        t_core = time.perf_counter()
        runner = core.runner.describe()
        print(f"checkpoint {t_ckpt - t_start:.1f} s, load + capture {t_core - t_ckpt:.1f} s, runner "
              f"{json.dumps({k: runner.get(k) for k in ('runner', 'graphs', 'capture_s', 'graph_mib')})}", flush=True)
        setup = setup_info(device, dtype, args.small) | dict(
            model=f"tiny {args.family} (encoder_service/testing/tiny.py)" if args.small else
            f"{NAMES[args.family]} vision tower", flow=args.flow, transport=args.transport, clients=args.clients,
            duration_s=args.duration_s, cache_bytes=settings.cache.cache_bytes,
            max_pinned_bytes=settings.cache.max_pinned_bytes, lease_s=settings.cache.lease_s,
            runner=runner["runner"], graphs=runner.get("graphs", 0), batch_tokens=settings.engine.batch_tokens,
            max_queue=settings.engine.max_queue, cpu_count=os.cpu_count(),
            attention=f"{args.attention}: {runner.get('attention', {}).get('selected', {})}",
            preprocess=core.metadata().get("preprocess"),
            # asyncio sets TCP_NODELAY on accepted connections only when the listening socket says IPPROTO_TCP
            http_server_nodelay=http_sock.proto == socket.IPPROTO_TCP)
        if not args.small:
            setup["vision"] = json.dumps(REAL[args.family])
        model = model_alone_table(core, cfg, device)
        t_model = time.perf_counter()

        svc = in_process_service(settings, http_sock, core=core)
        setup["rows_sent_by"] = svc.service.rows_written_by
        try:
            print(f"service up: {svc.url} grpc {svc.grpc_address}", flush=True)
            job = dict(http=svc.url, grpc=svc.grpc_address, cfg=cfg, flow=args.flow, transport=args.transport,
                       clients=args.clients)
            job_path = Path(tmp) / "job.json"
            job_path.write_text(json.dumps(job))
            try:
                result = drive(job_path, job, cfg["client_limit_s"])
            except RuntimeError as exc:  # a load generator died or hung (it was killed)
                result, client_status = None, str(exc)
        finally:
            svc.close()
    t_end = time.perf_counter()

    checks = []
    if result is None:
        checks.append(f"load generator failed ({client_status})")
        result = dict(levels=[], fetch=[], fetch_checks=[], jpeg_kb=None)
    levels, fetch = result["levels"], result["fetch"]
    for r in levels:
        if r["errors"]:
            checks.append(f"concurrency {r['concurrency']}: {r['errors']} errors, e.g. {r['error_samples'][:1]}")
        if r["cache_hits"]:
            checks.append(f"concurrency {r['concurrency']}: {r['cache_hits']} cache hits on distinct images")
        if not r["requests"]:
            checks.append(f"concurrency {r['concurrency']}: no request completed")
    checks += result["fetch_checks"]

    ref = model["images_per_s"]
    best_level = max(levels, key=lambda r: r["images_per_s"]) if levels else dict(images_per_s=0.0, concurrency=None)
    summary = dict(model_alone={k: model[k] for k in ("images_per_s", "batch", "route")},
                   service_images_per_s=best_level["images_per_s"], service_concurrency=best_level["concurrency"],
                   service_fraction=best_level["images_per_s"] / ref,
                   service_target_met=best_level["images_per_s"] >= SERVICE_TARGET * ref,
                   fetch_p50_ms={f["transport"]: f["p50_ms"] for f in fetch},
                   fetch_target_met={f["transport"]: f["p50_ms"] <= FETCH_TARGET_MS for f in fetch},
                   seconds=dict(checkpoint=t_ckpt - t_start, load_and_capture=t_core - t_ckpt,
                                model_alone=t_model - t_core, service_and_load=t_end - t_model,
                                total=t_end - t_start))
    setup["jpeg_kb"] = None if result.get("jpeg_kb") is None else round(result["jpeg_kb"])
    notes = []
    if args.small:
        notes.append("--small: a CPU smoke test of the script; its numbers say nothing about the targets.")
    if not setup["http_server_nodelay"]:
        notes.append("The HTTP listening socket (api/service.py: bind_socket) was made with proto 0, so asyncio does "
                     "not set TCP_NODELAY on the connections it accepts: on keep-alive connections a response "
                     "written in two parts waits for the client's delayed ACK (~40 ms on Linux loopback). HTTP "
                     "latencies above include that stall.")
    report = markdown(setup, model, levels, fetch, summary, checks, notes)
    write_result("load_bench", setup, dict(
        summary=summary, model_alone=model["rows"], levels=levels, fetch=fetch, failed_checks=checks, notes=notes,
        targets=dict(service_fraction=SERVICE_TARGET, fetch_p50_ms=FETCH_TARGET_MS)), report)
    print(report)
    print(f"total {t_end - t_start:.1f} s")
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
