"""ViT speed on the GPU: our runners (eager and CUDA graphs) against transformers (sdpa), same weights.

The graphs are the service's: settings' default bucket ladder (`--graph-buckets`) plus the exact buckets of
the common resolutions under its largest bucket, as make_runner builds them.

For Qwen2.5-VL-7B and Qwen3-VL-8B (random weights at the real sizes, built by gpu_parity.py's
`build_reference`: transformers' vision model, saved and loaded by our loader), per case (448x448, 720p,
1080p, 2560x1440, 8 x 448x448, 32 mixed sizes): median ms of `runner.encode` (bf16 pixel values already on
the GPU; wall clock around a synchronized call, so host overhead counts), patch tokens/s, model FLOP/s and
MFU against a bf16 matmul ceiling measured in the same run (FLOPs: every linear of the tower at its real,
unpadded width + attention QK^T and PV over the real segments/windows), eager vs graphs, the speedup over
transformers on the same inputs, and the max relative error of our rows against transformers'.

    python benchmarks/bench_vit.py            # GPU: real sizes, bf16; a few minutes
    python benchmarks/bench_vit.py --small    # CPU: tiny towers, float32 (smoke test of the script)

Writes $OUT/bench_vit.json and $OUT/bench_vit.md (OUT defaults to ./gpu_out); $OUT/profile_<family>.txt
holds a kernel-time breakdown of one eager 1080p forward.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_parity import REAL, SMALL, build_reference, patch_grid, reference_rows, setup_info  # noqa: E402

from encoder_service.models.loader import load_model  # noqa: E402
from encoder_service.runtime.graphs import GraphRunner  # noqa: E402
from encoder_service.runtime.runner import EagerRunner, exact_resolution_buckets  # noqa: E402
from encoder_service.settings import DEFAULT_BUCKETS, parse_buckets  # noqa: E402

NAMES = {"qwen2_5_vl": "Qwen2.5-VL-7B", "qwen3_vl": "Qwen3-VL-8B"}
MIXED_SIZES = [(224, 224), (336, 336), (448, 448), (512, 384), (640, 480), (800, 600), (1024, 768), (1280, 720)]
CASES = {
    "448x448": [(448, 448)],
    "720p": [(1280, 720)],
    "1080p": [(1920, 1080)],
    "2560x1440": [(2560, 1440)],
    "8 x 448x448": [(448, 448)] * 8,
    "32 mixed": [random.Random(0).choice(MIXED_SIZES) for _ in range(32)],
}
SMALL_CASES = {"112x112": [(112, 112)], "224x160": [(224, 160)], "4 x 112x112": [(112, 112)] * 4,
               "8 mixed": [(112, 112), (224, 160), (96, 200), (64, 64)] * 2}
FP32_CASES = {"448x448", "720p", "1080p", "8 x 448x448", "112x112", "4 x 112x112"}
TARGETS_MS = {("qwen2_5_vl", "448x448"): 3, ("qwen2_5_vl", "1080p"): 35, ("qwen2_5_vl", "8 x 448x448"): 20,
              ("qwen3_vl", "720p"): 10, ("qwen3_vl", "1080p"): 30}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device, min_iters: int, max_iters: int, budget_s: float) -> tuple[float, int]:
    """Median wall-clock ms of fn() (synchronized), after 2 warm-up calls."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), len(times)


def matmul_ceiling(device, dtype) -> float:
    """bf16 TFLOP/s of an 8192^3 matmul (median of 20), measured here."""
    if device.type != "cuda":
        return float("nan")
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return 2 * n**3 / statistics.median(times) / 1e9


def tower_flops(tower, grids) -> float:
    """Useful FLOPs of one forward: linears at real widths + attention over real segments."""
    c = tower.config
    e, patches = c.hidden_size, sum(t * h * w for t, h, w in grids)
    meta = tower.metadata(grids)
    full = meta.cu_seqlens.diff().double().pow(2).sum().item()
    window = meta.cu_window_seqlens.diff().double().pow(2).sum().item() if meta.cu_window_seqlens is not None else None
    per_token = 2 * (e * 3 * e + e * e)  # qkv + proj
    per_token += 2 * 3 * e * c.intermediate_size if c.FAMILY == "qwen2_5_vl" else 2 * 2 * e * c.intermediate_size
    flops = patches * (2 * c.patch_dim * e + c.depth * per_token)
    for i in range(c.depth):
        windowed = c.FAMILY == "qwen2_5_vl" and i not in c.fullatt_block_indexes
        flops += 4 * e * (window if windowed else full)
    unit = e * c.merge_size**2
    mergers = 1 + getattr(c, "num_deepstack", 0)
    flops += mergers * 2 * (patches // c.merge_size**2) * (unit * unit + unit * c.out_hidden_size)
    return flops


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor, width: int) -> float:
    """Worst over the row levels (main, deepstack_k) of max|ours - ref| / max|ref|."""
    worst = 0.0
    for s in range(0, ref.shape[1], width):
        o, r = ours[:, s : s + width].float(), ref[:, s : s + width].float()
        worst = max(worst, ((o - r).abs().max() / r.abs().max()).item())
    return worst


def profile_eager(runner, pvs, grids, path: Path):
    """Kernel-time breakdown of one eager forward (torch.profiler), grouped by kind."""
    from torch.profiler import ProfilerActivity, profile

    runner.encode(pvs, grids)
    sync(runner.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.encode(pvs, grids)
        sync(runner.device)
    groups: dict[str, float] = {}
    kernels = []
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us <= 0:
            continue
        name = evt.key
        low = name.lower()
        if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90")) and "flash" not in low:
            kind = "GEMM"
        elif any(s in low for s in ("flash", "fmha", "cudnn", "attention", "short_segment")):
            kind = "attention"
        elif "triton" in low or low.startswith("_"):
            kind = "triton (fused elementwise)"
        else:
            kind = "other (torch elementwise, copies)"
        groups[kind] = groups.get(kind, 0) + us
        kernels.append((us, evt.count, name[:110]))
    total = sum(groups.values())
    lines = [f"total kernel time {total / 1e3:.2f} ms"]
    lines += [f"  {k:34s} {v / 1e3:8.2f} ms  {100 * v / total:5.1f}%" for k, v in sorted(groups.items(), key=lambda x: -x[1])]
    lines += ["", "top kernels (ms, calls, name):"]
    lines += [f"  {us / 1e3:8.3f} {n:5d}  {name}" for us, n, name in sorted(kernels, reverse=True)[:25]]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]), flush=True)


def replay_ms(graph, device) -> float:
    """GPU time of one replay of a captured graph (CUDA events, median of 20): no host work."""
    times = []
    for _ in range(22):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times[2:])


@torch.no_grad()
def bench_family(family, vision, cases, device, dtype, ceiling, args, out_dir) -> list[dict]:
    import copy

    with tempfile.TemporaryDirectory() as tmp:
        reference = build_reference(family, vision, device, dtype, Path(tmp))
        loaded = load_model(tmp, device=device, dtype=dtype)
    # float32 copy of the same weights: the reference both bf16 runs are measured against.
    reference32 = copy.deepcopy(reference).float() if device.type == "cuda" else None
    eager = EagerRunner(loaded)
    buckets = list(args.graph_buckets) if not args.small else [64, 128, 256, 512]
    t0 = time.perf_counter()
    # "graphs": every batch that fits a bucket replays a graph; "service": make_runner's default policy
    # (big batches that a bucket would pad by more than 5% run eagerly).
    exact = exact_resolution_buckets(loaded.spec, max(buckets)) if not args.small else [64, 96]
    graphs = GraphRunner(loaded, buckets=buckets, capture=device.type == "cuda", eager_min_patches=None,
                         exact_buckets=exact)
    (out_dir / f"capture_{family}.json").write_text(json.dumps(graphs.capture_log))
    c = loaded.tower.config
    print(f"{family}: MLP width {c.intermediate_size} -> {c.intermediate_size_padded}; graphs {graphs.describe()} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    width = loaded.spec.out_hidden_size
    results = []
    for case, sizes in cases.items():
        grids = [patch_grid(w, h, vision["patch_size"]) for w, h in sizes]
        patches = sum(t * h * w for t, h, w in grids)
        gen = torch.Generator().manual_seed(1)
        pvs = [torch.randn(t * h * w, loaded.spec.patch_dim, generator=gen).to(device, dtype) for t, h, w in grids]
        flat = torch.cat(pvs)
        grid_tensor = torch.tensor(grids, device=device)
        ref = reference_rows(reference(flat, grid_thw=grid_tensor))
        row = dict(family=family, model=NAMES.get(family, family), case=case, images=len(grids), patches=patches,
                   flops=tower_flops(loaded.tower, grids))
        outs = {}
        for name, runner in (("eager", eager), ("graphs", graphs)):
            outs[name] = torch.cat(runner.encode(pvs, grids))
            row[f"{name}_err"] = max_rel_err(outs[name], ref, width)
            ms, n = time_call(lambda r=runner: r.encode(pvs, grids), device, 5, 200, args.budget_s)
            row[f"{name}_ms"], row[f"{name}_iters"] = ms, n
        ms, n = time_call(lambda: reference(flat, grid_thw=grid_tensor), device, 3, 30, args.budget_s)
        row["transformers_ms"], row["transformers_iters"] = ms, n
        graph_plan = graphs.plan(grids)
        buckets_used = [b.bucket for b, _ in graph_plan]
        row["buckets"] = buckets_used
        if device.type == "cuda" and len(graph_plan) == 1 and graph_plan[0][1] is not None:
            row["replay_gpu_ms"] = replay_ms(graph_plan[0][1], device)
        graphs.eager_min_patches = 8192
        routes = ["eager" if g is None else "graphs" for _, g in graphs.plan(grids)]
        if all(r == "graphs" for r in routes):
            row["service_path"], best = "graphs", row["graphs_ms"]
        elif all(r == "eager" for r in routes):
            row["service_path"], best = "eager", row["eager_ms"]
        else:
            row["service_path"] = "mixed"
            best, _ = time_call(lambda: graphs.encode(pvs, grids), device, 5, 200, args.budget_s)
        graphs.eager_min_patches = None
        row["service_ms"] = best
        row["tokens_per_s"] = patches / best * 1e3
        row["tflops"] = row["flops"] / best / 1e9
        row["mfu"] = row["tflops"] / ceiling if ceiling == ceiling else None
        row["speedup"] = row["transformers_ms"] / best
        row["target_ms"] = TARGETS_MS.get((family, case))
        if reference32 is not None and case in FP32_CASES:
            ref32 = reference_rows(reference32(flat.float(), grid_thw=grid_tensor))
            row["fp32_err_ours"] = max_rel_err(outs["graphs" if row["service_path"] == "graphs" else "eager"], ref32, width)
            row["fp32_err_transformers"] = max_rel_err(ref, ref32, width)
            del ref32
        results.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if device.type == "cuda":
        case = "1080p"
        grids = [patch_grid(w, h, vision["patch_size"]) for w, h in CASES[case]]
        pvs = [torch.randn(t * h * w, loaded.spec.patch_dim, device=device, dtype=dtype) for t, h, w in grids]
        profile_eager(eager, pvs, grids, out_dir / f"profile_{family}.txt")
    del reference, reference32, loaded, eager, graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def markdown(setup: dict, ceiling: float, rows: list[dict]) -> str:
    lines = [
        "| model | case | patches | eager ms | graphs ms | service ms (path) | transformers ms | speedup "
        "| patch tok/s | TFLOP/s | MFU | max rel err | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = "" if r["target_ms"] is None else f"<= {r['target_ms']} ms " + (
            "met" if r["service_ms"] <= r["target_ms"] else "MISSED")
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.0f}%"
        replay = f" ({r['replay_gpu_ms']:.2f} GPU)" if "replay_gpu_ms" in r else ""
        lines.append(
            f"| {r['model']} | {r['case']} | {r['patches']} | {r['eager_ms']:.2f} | {r['graphs_ms']:.2f}{replay} "
            f"| {r['service_ms']:.2f} ({r['service_path']}) | {r['transformers_ms']:.1f} | {r['speedup']:.1f}x "
            f"| {r['tokens_per_s'] / 1e6:.2f} M | {r['tflops']:.0f} | {mfu} "
            f"| {max(r['eager_err'], r['graphs_err']):.1e} | {target} |"
        )
    lines += ["", "Against a float32 run of the same transformers weights (max|diff| / max|ref|, worst level):", "",
              "| model | case | ours bf16 | transformers bf16 |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['case']} | {r['fp32_err_ours']:.1e} | {r['fp32_err_transformers']:.1e} |"
              for r in rows if "fp32_err_ours" in r]
    head = ", ".join(f"{k}: {v}" for k, v in setup.items()) + f", bf16 matmul ceiling: {ceiling:.0f} TFLOP/s"
    return head + "\n\n" + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny towers, float32, CPU")
    parser.add_argument("--family", choices=sorted(REAL), action="append", help="default: both")
    parser.add_argument("--case", action="append", help="only these cases")
    parser.add_argument("--budget-s", type=float, default=1.0, help="timing budget per measurement")
    parser.add_argument("--graph-buckets", type=parse_buckets, default=DEFAULT_BUCKETS,
                        help="patch-token buckets (default: the service's, %(default)s)")
    args = parser.parse_args()
    if not args.small and not torch.cuda.is_available():
        parser.error("needs a CUDA device (use --small for a CPU smoke test)")
    device = torch.device("cpu" if args.small else "cuda")
    dtype = torch.float32 if args.small else torch.bfloat16
    configs, cases = (SMALL, SMALL_CASES) if args.small else (REAL, CASES)
    if args.case:
        cases = {k: v for k, v in cases.items() if k in args.case}
    out_dir = Path(os.environ.get("OUT", "gpu_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = setup_info(device, dtype, args.small)
    ceiling = matmul_ceiling(device, dtype)
    print(json.dumps(setup), f"ceiling {ceiling:.0f} TFLOP/s", flush=True)
    rows = []
    for family in args.family or list(configs):
        rows += bench_family(family, configs[family], cases, device, dtype, ceiling, args, out_dir)
        (out_dir / "bench_vit.json").write_text(json.dumps(dict(setup=setup, ceiling_tflops=ceiling, rows=rows), indent=2))
    md = markdown(setup, ceiling, rows)
    (out_dir / "bench_vit.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
