"""ViT speed on the GPU: our runners (eager and CUDA graphs) against transformers (sdpa), same weights,
one row set per attention choice (`--attention auto,fa4,torch`: the runners' attention policy,
ops/attention.py; the `attention` column says which backend served which layout class). The MLP kernels
(ops/mlp_kernels.py) are auto's, except with `torch`: then without quack, which comes with FA4 (the [fa4]
extra), so those rows are what a machine without the extra runs; the `mlp` column says what served.

The graphs are the service's: settings' default bucket ladder (`--graph-buckets`) plus the exact buckets of
the common resolutions under its largest bucket, as make_runner builds them.

For Qwen2.5-VL-7B and Qwen3-VL-8B (random weights at the real sizes, built by tests/support/vision_checkpoints.py's
`build_reference`: transformers' vision model, saved and loaded by our loader), per case (448x448, 720p,
1080p, 2560x1440, 8 x 448x448, 32 mixed sizes): median ms of `runner.encode` (bf16 pixel values already on
the GPU; wall clock around a synchronized call, so host overhead counts), patch tokens/s, model FLOP/s and
MFU against a bf16 matmul ceiling measured in the same run (FLOPs: every linear of the tower at its real,
unpadded width + attention QK^T and PV over the real segments/windows), eager vs graphs, the speedup over
transformers on the same inputs, and the max relative error of our rows against transformers'. transformers
runs once per case (its output is the reference of every choice); `--no-transformers-timing` skips timing it.
A choice whose backend is not installed (fa4 without flash-attn-4) is skipped.

    python -m benchmarks.bench_vit            # GPU: real sizes, bf16, --attention auto; a few minutes
    python -m benchmarks.bench_vit --attention auto,fa4,torch --case 1080p --case "8 x 448x448" \
        --no-transformers-timing            # before/after rows; each choice captures its own graphs (~20 s)
    python -m benchmarks.bench_vit --small    # CPU: tiny towers, float32 (smoke test of the script)

Writes benchmarks/results/bench_vit-<date>-<commit>.json and $OUT/bench_vit.md (benchmarks/common/report.py:
where, with and without OUT), rewritten after each choice; $OUT/profile_<family>_<choice>.txt holds a
kernel-time breakdown of one eager 1080p forward with that choice's backends (attention labelled by backend
through profiler ranges) and of one replay of its graph.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.device import bench_device, sync
from benchmarks.common.models import NAMES, REAL, SMALL, build_reference, patch_grid, reference_rows
from benchmarks.common.report import out_dir, setup_info, write_result
from encoder_service.models.loader import load_model
from encoder_service.ops import attention, mlp_kernels
from encoder_service.runtime.graphs import GraphRunner
from encoder_service.runtime.eager import EagerRunner
from encoder_service.runtime.runner import exact_resolution_buckets
from encoder_service.settings import DEFAULT_BUCKETS, parse_buckets

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


ATTENTION_KERNELS = ("attn", "flash", "fmha", "cudnn", "attention", "sdpa", "short_segment")


def kernel_breakdown(prof) -> list[str]:
    """Report lines: a profile's CUDA kernels grouped by kind (attention by kernel-name patterns)."""
    from torch.autograd import DeviceType

    per_name: dict[str, list] = {}
    for evt in prof.events():
        # "attention:<backend>" ranges (attention_ranges) show up on the device too, spanning their kernels: they
        # are not kernels, and counting them would count attention twice.
        if evt.device_type == DeviceType.CUDA and evt.device_time_total > 0 and not evt.name.startswith("attention:"):
            entry = per_name.setdefault(evt.name, [0.0, 0])
            entry[0] += evt.device_time_total
            entry[1] += 1
    groups: dict[str, float] = {}
    for name, (us, _) in per_name.items():
        low = name.lower()
        if any(s in low for s in ATTENTION_KERNELS):
            kind = "attention"
        elif any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90")):
            kind = "GEMM"
        elif "triton" in low or low.startswith("_"):
            kind = "triton (fused elementwise)"
        else:
            kind = "other (torch elementwise, copies)"
        groups[kind] = groups.get(kind, 0) + us
    total = sum(groups.values()) or 1e-9
    lines = [f"total kernel time {total / 1e3:.2f} ms ({len(per_name)} distinct kernels)"]
    lines += [f"  {k:34s} {v / 1e3:8.2f} ms  {100 * v / total:5.1f}%"
              for k, v in sorted(groups.items(), key=lambda x: -x[1])]
    lines += ["", "top kernels (ms, calls, name):"]
    top = sorted(((us, n, name[:110]) for name, (us, n) in per_name.items()), reverse=True)[:25]
    lines += [f"  {us / 1e3:8.3f} {n:5d}  {name}" for us, n, name in top]
    return lines


@contextlib.contextmanager
def attention_ranges():
    """While the block runs, each call of an attention backend (ops/attention.py: BACKENDS) is inside a
    torch.profiler range "attention:<backend>"; the backends are put back after."""
    backends = dict(attention.BACKENDS)

    def labelled(name, run):
        def run_in_range(*args):
            with torch.profiler.record_function(f"attention:{name}"):
                return run(*args)
        return run_in_range

    for name, backend in backends.items():
        attention.BACKENDS[name] = dataclasses.replace(backend, run=labelled(name, backend.run))
    try:
        yield
    finally:
        attention.BACKENDS.update(backends)


def profile_forward(eager, graph_runner, pvs, grids, path: Path):
    """Kernel-time breakdown (torch.profiler) of one eager forward with the runner's attention backends, each
    attention call inside a range "attention:<backend>" (attention_ranges), and of one replay
    of the graph the graph runner picks for these images (kernels inside a graph are listed when CUPTI
    reports them)."""
    from torch.profiler import ProfilerActivity, profile

    eager.encode(pvs, grids)
    sync(eager.device)
    with attention_ranges(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eager.encode(pvs, grids)
        sync(eager.device)
    lines = kernel_breakdown(prof)
    ranges: dict[str, tuple[int, float]] = {}  # one row per range (its host and its device record share the key)
    for e in prof.key_averages():
        if e.key.startswith("attention:"):
            n, us = ranges.get(e.key, (0, 0.0))
            ranges[e.key] = (max(n, e.count), max(us, e.device_time_total))
    ranges = sorted((key, n, us) for key, (n, us) in ranges.items())
    lines = ["eager forward, attention " + str(eager.attention.selected()), lines[0],
             *[f"  {key:34s} {us / 1e3:8.2f} ms  ({n} calls; kernels inside the range)" for key, n, us in ranges],
             *lines[1:]]
    plan = graph_runner.plan(grids)
    if len(plan) == 1 and plan[0][1] is not None and plan[0][1].graph is not None:
        graph = plan[0][1]
        graph_runner.encode(pvs, grids)  # the batch's buffers in the graph
        sync(eager.device)
        with profile(activities=[ProfilerActivity.CUDA]) as gprof:
            graph.graph.replay()
            sync(eager.device)
        glines = kernel_breakdown(gprof)
        lines += ["", f"one replay of graph {graph.bucket}/{graph.kind}:", *glines]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]), flush=True)


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


def short_backends(policy) -> str:
    """'one:fa4 several:fa4 windows:triton_short' from the policy's selections (what the runners ran)."""
    seen: dict[str, str] = {}
    for key, name in policy.selected().items():
        seen.setdefault(key.split("/")[0], name)
    return " ".join(f"{cls}:{name}" for cls, name in seen.items())


@torch.no_grad()
def bench_family(family, vision, cases, device, dtype, ceiling, args, out: Path, rows: list, save) -> None:
    import copy

    with tempfile.TemporaryDirectory() as tmp:
        reference = build_reference(family, vision, device, dtype, Path(tmp))
        loaded = load_model(tmp, device=device, dtype=dtype)
    # float32 copy of the same weights: the reference both bf16 runs are measured against.
    reference32 = copy.deepcopy(reference).float() if device.type == "cuda" else None
    width = loaded.spec.out_hidden_size
    # transformers once per case: the inputs, its rows (the reference of every attention choice), its time
    inputs = {}
    for case, sizes in cases.items():
        grids = [patch_grid(w, h, vision["patch_size"]) for w, h in sizes]
        gen = torch.Generator().manual_seed(1)
        pvs = [torch.randn(t * h * w, loaded.spec.patch_dim, generator=gen).to(device, dtype) for t, h, w in grids]
        flat, grid_tensor = torch.cat(pvs), torch.tensor(grids, device=device)
        inp = dict(grids=grids, pvs=pvs, ref=reference_rows(reference(flat, grid_thw=grid_tensor)),
                   transformers_ms=None, transformers_iters=0, ref32=None)
        if not args.no_transformers_timing:
            inp["transformers_ms"], inp["transformers_iters"] = time_call(
                functools.partial(reference, flat, grid_thw=grid_tensor), device, 3, 30, args.budget_s)
        if reference32 is not None and case in FP32_CASES:
            inp["ref32"] = reference_rows(reference32(flat.float(), grid_thw=grid_tensor))
        inputs[case] = inp
    del reference, reference32
    buckets = list(args.graph_buckets) if not args.small else [64, 128, 256, 512]
    exact = exact_resolution_buckets(loaded.spec, max(buckets)) if not args.small else [64, 96]
    c = loaded.tower.config
    for choice in args.attention:
        policy = attention.AttentionPolicy(choice)
        needs = {"fa4": "fa4"}.get(choice)
        why = policy.missing(needs, device) if needs else ""
        if why:
            print(f"{family}: attention {choice} skipped: {why}", flush=True)
            SKIPPED.append(dict(family=family, attention=choice, why=why))
            continue
        mlp = mlp_kernels.MlpKernelPolicy(
            "auto", available={"quack": "left out: it comes with FA4"} if choice == "torch" else None)
        with mlp_kernels.use_policy(mlp):  # around the captures and every eager forward
            eager = EagerRunner(loaded, attention=policy)
            t0 = time.perf_counter()
            # "graphs": every batch that fits a bucket replays a graph; "service": make_runner's default policy
            # (big batches that a bucket would pad by more than 5% run eagerly).
            graphs = GraphRunner(loaded, buckets=buckets, capture=device.type == "cuda", eager_min_patches=None,
                                 exact_buckets=exact, attention=policy)
            (out / f"capture_{family}_{choice}.json").write_text(json.dumps(graphs.capture_log))
            print(f"{family} attention={choice}: MLP width {c.intermediate_size} -> {c.intermediate_size_padded}; "
                  f"graphs {graphs.describe()} ({time.perf_counter() - t0:.1f} s)", flush=True)
            for case, inp in inputs.items():
                rows.append(measure_case(family, case, inp, loaded, eager, graphs, width, device, ceiling, args))
                rows[-1].update(attention=choice, attention_backends=short_backends(policy),
                                mlp_backends=" ".join(sorted({f"{k.split('/')[0]}:{v}"
                                                              for k, v in mlp.describe()["selected"].items()})))
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                      flush=True)
            if device.type == "cuda":
                grids = [patch_grid(w, h, vision["patch_size"]) for w, h in CASES["1080p"]]
                pvs = [torch.randn(t * h * w, loaded.spec.patch_dim, device=device, dtype=dtype)
                       for t, h, w in grids]
                profile_forward(eager, graphs, pvs, grids, out / f"profile_{family}_{choice}.txt")
        save()
        del eager, graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del loaded, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_case(family, case, inp, loaded, eager, graphs, width, device, ceiling, args) -> dict:
    grids, pvs, ref = inp["grids"], inp["pvs"], inp["ref"]
    patches = sum(t * h * w for t, h, w in grids)
    row = dict(family=family, model=NAMES.get(family, family), case=case, images=len(grids), patches=patches,
               flops=tower_flops(loaded.tower, grids), transformers_ms=inp["transformers_ms"],
               transformers_iters=inp["transformers_iters"])
    outs = {}
    for name, runner in (("eager", eager), ("graphs", graphs)):
        outs[name] = torch.cat(runner.encode(pvs, grids))
        row[f"{name}_err"] = max_rel_err(outs[name], ref, width)
        ms, n = time_call(lambda r=runner: r.encode(pvs, grids), device, 5, 200, args.budget_s)
        row[f"{name}_ms"], row[f"{name}_iters"] = ms, n
    graph_plan = graphs.plan(grids)
    row["buckets"] = [b.bucket for b, _ in graph_plan]
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
    row["speedup"] = row["transformers_ms"] / best if row["transformers_ms"] else None
    row["target_ms"] = TARGETS_MS.get((family, case))
    if inp["ref32"] is not None:
        ours = outs["graphs" if row["service_path"] == "graphs" else "eager"]
        row["fp32_err_ours"] = max_rel_err(ours, inp["ref32"], width)
        row["fp32_err_transformers"] = max_rel_err(ref, inp["ref32"], width)
    return row


SKIPPED: list[dict] = []  # attention choices whose backend is not installed here


def markdown(setup: dict, ceiling: float, rows: list[dict]) -> str:
    lines = [
        "| model | case | attention | mlp | patches | eager ms | graphs ms | service ms (path) | transformers ms "
        "| speedup | patch tok/s | TFLOP/s | MFU | max rel err | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = "" if r["target_ms"] is None else f"<= {r['target_ms']} ms " + (
            "met" if r["service_ms"] <= r["target_ms"] else "MISSED")
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.0f}%"
        replay = f" ({r['replay_gpu_ms']:.2f} GPU)" if "replay_gpu_ms" in r else ""
        hf = "-" if r["transformers_ms"] is None else f"{r['transformers_ms']:.1f}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        lines.append(
            f"| {r['model']} | {r['case']} | {r['attention']} ({r['attention_backends'] or '-'}) "
            f"| {r['mlp_backends'] or '-'} | {r['patches']} "
            f"| {r['eager_ms']:.2f} | {r['graphs_ms']:.2f}{replay} | {r['service_ms']:.2f} ({r['service_path']}) "
            f"| {hf} | {speedup} | {r['tokens_per_s'] / 1e6:.2f} M | {r['tflops']:.0f} | {mfu} "
            f"| {max(r['eager_err'], r['graphs_err']):.1e} | {target} |"
        )
    if SKIPPED:
        lines += [""] + [f"- attention {s['attention']} skipped for {s['family']}: {s['why']}" for s in SKIPPED]
    lines += ["", "Against a float32 run of the same transformers weights (max|diff| / max|ref|, worst level):", "",
              "| model | case | attention | ours bf16 | transformers bf16 |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['case']} | {r['attention']} | {r['fp32_err_ours']:.1e} "
              f"| {r['fp32_err_transformers']:.1e} |" for r in rows if "fp32_err_ours" in r]
    head = ", ".join(f"{k}: {v}" for k, v in setup.items()) + f", bf16 matmul ceiling: {ceiling:.0f} TFLOP/s"
    return head + "\n\n" + "\n".join(lines) + "\n"


def attention_choices(text: str) -> list[str]:
    choices = [c.strip().lower() for c in text.split(",") if c.strip()]
    unknown = [c for c in choices if c not in attention.CHOICES]
    if unknown or not choices:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(attention.CHOICES)}, got {text!r}")
    return list(dict.fromkeys(choices))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny towers, float32, CPU")
    parser.add_argument("--family", choices=sorted(REAL), action="append", help="default: both")
    parser.add_argument("--case", action="append", help="only these cases (default: all)")
    parser.add_argument("--attention", type=attention_choices, default=["auto"],
                        help=f"comma list of {', '.join(attention.CHOICES)}: one row set each (default auto)")
    parser.add_argument("--no-transformers-timing", action="store_true",
                        help="do not time transformers (its output is still every row's reference)")
    parser.add_argument("--budget-s", type=float, default=1.0, help="timing budget per measurement")
    parser.add_argument("--graph-buckets", type=parse_buckets, default=DEFAULT_BUCKETS,
                        help="patch-token buckets (default: the service's, %(default)s)")
    args = parser.parse_args()
    device, dtype = bench_device(args.small, parser)
    configs, cases = (SMALL, SMALL_CASES) if args.small else (REAL, CASES)
    if args.case:
        unknown = set(args.case) - set(cases)
        if unknown:
            parser.error(f"unknown cases {sorted(unknown)}; known: {list(cases)}")
        cases = {k: v for k, v in cases.items() if k in args.case}
    out = out_dir()
    setup = setup_info(device, dtype, args.small)
    ceiling = matmul_ceiling(device, dtype)
    print(json.dumps(setup), f"ceiling {ceiling:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []

    def save():
        write_result("bench_vit", setup, dict(ceiling_tflops=ceiling, rows=rows, skipped=SKIPPED),
                     markdown(setup, ceiling, rows))

    for family in args.family or list(configs):
        bench_family(family, configs[family], cases, device, dtype, ceiling, args, out, rows, save)
    save()
    print(markdown(setup, ceiling, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
