"""Attention candidates side by side on one GPU, in one bounded run (issue 14): which backend for which layout.

For every layout the towers' attention sees (built by the graphs' own padding rule, models/metadata.py: the
exact-bucket 1080p / 720p images, an image padded into a "single" graph, 8 images in a "multi" graph with
its filler slots, the same 8 eagerly, Qwen2.5's windows) x every candidate that serves it:
  * numerics against float32 attention (ops/attention.py: reference_attention) on random inputs, the
    output poisoned with NaN first (rows a candidate does not write show up as nan_rows): max abs error and
    ||out - ref|| / ||ref|| (pass: no NaN, <= 2e-2);
  * eager time: median of CUDA-event pairs around single calls after warm-up (first_call_s: JIT included);
  * CUDA graph: capture once, a SECOND random set into the captured buffers, output poisoned, replay,
    numerics again (the graph reads live buffers and writes every row), then the median of replays;
  * whether torch's default CUDA RNG still works after capture and replays (aten's cuDNN attention broke it).
q and k are contiguous, v is the strided [:, 2] view of a fused [N, 3, H, D] buffer, as in the towers.

Candidates: the production backends exactly as the service runs them (ops/attention.py BACKENDS: fa4,
triton_short, torch_dense, torch_two_segment, torch_varlen; and "auto" = the service's own choice on this
machine, noted in the table), plus what the service does not run (benchmarks/attention/extras.py: fa4_dense,
cudnn_fe, cudnn_fe_backend, cudnn_fe_op, torch_sdpa_*) and triton_split per block config: our head-dim-split
Triton kernel, REJECTED on the H100 (slower than FA4 everywhere, wrong on several layouts) and out of the
service, measured from benchmarks/attention/triton_split.py so that the result stays reproducible.

Robustness: the items run in a worker process; the driver restarts a worker that crashes (illegal address,
abort), falls silent for --stall-s, or leaves the default RNG broken, recording the item as crashed /
hung; a candidate that crashes twice is skipped. Items run in priority passes, so a run cut by the time
budget (--budget-s: no item starts after it, a worker still running at it is killed) still has the
essentials for every layout. Inputs come from explicit generators (a broken default RNG cannot touch them).

    python3 -m benchmarks.attention.candidates --list      # layouts and items; no GPU needed
    python3 -m benchmarks.attention.candidates             # GPU; about 4-5 min (budget 330 s)
    ... --layouts q3_1080p,q25_1080p --candidates fa4,torch_dense,triton_split --budget-s 120

Writes benchmarks/results/attention_candidates-<date>-<commit>.json (env, layouts, every record, winners) and
in $OUT attention_candidates.md (table, best per layout, per layout class), attention_candidates.jsonl (the
raw stream) and attention_candidates_worker.log (benchmarks/common/report.py: where, with and without OUT).

On the GPU machine (H100), with FlashAttention-4 and cudnn-frontend: their wheels (111 MB; the CuTe DSL's
cu13 library alone is 92 MB) do not fit the 64 MiB of one device call, so they travel in two calls in a
row (the machine stays warm 30 s between calls; /tmp survives while it is warm). Here, once, from the
repo root, with the wheels in .gpuwhl/ (scripts/gpu/stage_wheels.sh lists them):

    bash scripts/gpu/stage_wheels.sh          # .gpuwhl/ -> .gpuwhl_stage1/ (56 MiB) + .gpuwhl_stage2/

then, back to back:

    run(kind="nvidia-h100-x1", carry=[".gpuwhl_stage1"], timeout_s=180,
        command="bash scripts/gpu/install_wheels.sh")
    run(carry=[".gpuwhl_stage2"], timeout_s=540, command="set -o pipefail; bash scripts/gpu/install_wheels.sh
        && PYTHONPATH=/tmp/site-packages PYTHONUNBUFFERED=1 python3 -m benchmarks.attention.candidates 2>&1
        | tee $OUT/bench.log")

If the machine went cold between the calls, the second call installs what it has (no CuTe DSL: FA4 and
cudnn-frontend's python engines report "unavailable") and says so; everything else still runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial

from benchmarks.common.children import module_command, module_env
from benchmarks.common.report import append_record, out_dir, read_records, stamp, write_result

HEADS = 16
REL_TOL = 2e-2
STARTUP_S = 120.0  # a new worker's allowance before its first record (imports, CUDA context)

# ---- layouts (host side only: importable without a GPU) ------------------------------------------


def _layout(name, family, head_dim, bounds, max_seqlen, desc, real_rows=None):
    from encoder_service.ops.attention import layout_class

    n, slots = bounds[-1], len(bounds) - 1
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    return dict(
        name=name, family=family, D=head_dim, H=HEADS, N=n, cu=list(bounds), slots=slots, max_seqlen=max_seqlen,
        cls=layout_class(n, slots, max_seqlen), desc=desc, real_rows=real_rows if real_rows is not None else n,
        segments=sum(1 for x in lengths if x > 0),
        flops=4.0 * sum(x * x for x in lengths) * head_dim * HEADS,  # QK^T + PV over every segment computed
    )


def service_graph(grids, patch_size: int) -> tuple[int, str]:
    """(bucket, graph kind) the service's GraphRunner picks for this batch: make_runner's buckets (settings'
    ladder + the exact buckets of the common resolutions under its top) and GraphRunner.plan's kind rule."""
    from types import SimpleNamespace

    from encoder_service.models.metadata import EXACT, MULTI, SINGLE
    from encoder_service.runtime.runner import exact_resolution_buckets
    from encoder_service.settings import DEFAULT_BUCKETS

    exact = set(exact_resolution_buckets(SimpleNamespace(patch_size=patch_size, merge_size=2), max(DEFAULT_BUCKETS)))
    patches = sum(t * h * w for t, h, w in grids)
    bucket = min(b for b in set(DEFAULT_BUCKETS) | exact if b >= patches)
    if len(grids) == 1 and grids[0][0] == 1:
        return bucket, SINGLE if bucket not in exact else (EXACT if patches == bucket else MULTI)
    return bucket, MULTI


def build_layouts() -> list[dict]:
    """The towers' layouts: the batch padded by models/metadata.py into the graph the service would pick for
    it (service_graph; 32 images per multi graph: 33 segment slots), or unpadded (eager)."""
    from encoder_service.models.metadata import PaddedShape, build_batch_metadata

    def layout(name, family, head_dim, patch_size, grids, eager, windows, desc):
        meta = build_batch_metadata(grids, merge=2, head_dim=head_dim, rope_theta=10000.0,
                                    window_units=4 if windows else None)
        real = meta.num_patches
        if not eager:
            bucket, kind = service_graph(grids, patch_size)
            shape = PaddedShape.for_graph(bucket, kind, max_images=32, merge_unit=4,
                                          window_units=4 if windows else None)
            meta = meta.padded(shape)
            desc = f"{desc}: graph {bucket}/{kind}"
        cu, max_seqlen = (meta.cu_window_seqlens, meta.max_window_seqlen) if windows else (meta.cu_seqlens,
                                                                                          meta.max_seqlen)
        return _layout(name, family, head_dim, cu.tolist(), max_seqlen, desc, real_rows=real)

    q3, q25 = ("qwen3_vl", 72, 16), ("qwen2_5_vl", 80, 14)
    specs = [  # name, (family, D, patch), grids, eager, windows, description
        ("q3_1080p", q3, [(1, 68, 120)], False, False, "Qwen3 1920x1088, one segment"),
        ("q25_1080p", q25, [(1, 78, 138)], False, False, "Qwen2.5 1932x1092, full-attention layers"),
        ("q25_1080p_win", q25, [(1, 78, 138)], False, True, "Qwen2.5 1932x1092, window layers"),
        ("q3_720p", q3, [(1, 44, 80)], False, False, "Qwen3 1280x704 (720p), one segment"),
        ("q3_1024x960_single", q3, [(1, 60, 64)], False, False, "Qwen3 1024x960: image + dummy segment"),
        ("q25_1036x1036_single", q25, [(1, 74, 74)], False, False, "Qwen2.5 1036x1036: image + dummy segment"),
        ("q3_8x448_multi", q3, [(1, 28, 28)] * 8, False, False, "Qwen3 8 x 448x448: 8 + dummy + empty slots"),
        ("q25_8x448_multi", q25, [(1, 32, 32)] * 8, False, False, "Qwen2.5 8 x 448x448: 8 + empty slots"),
        ("q3_8x448_eager", q3, [(1, 28, 28)] * 8, True, False, "Qwen3 8 x 448x448 eagerly: 8 x 784"),
        ("q25_8x448_eager", q25, [(1, 32, 32)] * 8, True, False, "Qwen2.5 8 x 448x448 eagerly: 8 x 1024"),
        ("q25_8x448_win_multi", q25, [(1, 32, 32)] * 8, False, True, "Qwen2.5 8 x 448x448, window layers"),
    ]
    return [layout(name, family, d, patch, grids, eager, windows, desc)
            for name, (family, d, patch), grids, eager, windows, desc in specs]


# ---- candidates -------------------------------------------------------------------------------------

# Block configs of the rejected split kernel (triton_split.py: SPLIT_CONFIGS) per layout.
TRITON_LONG = ["m128n64w8s2", "m128n128w8s2", "m128n64w4s3"]  # max_seqlen > 64
TRITON_SHORT = ["m64n64w4s2"]
PRODUCTION = ["auto", "fa4", "triton_short", "torch_dense", "torch_two_segment", "torch_varlen"]
EXTRA = ["cudnn_fe_backend", "fa4_dense", "cudnn_fe", "cudnn_fe_op", "torch_sdpa_flash", "torch_sdpa_efficient",
         "torch_sdpa_cudnn", "triton_split"]
CANDIDATES = PRODUCTION + EXTRA
# Priority passes, so that a run cut by the budget has the essentials for every layout:
#   1: the service's choice and every production backend, cuDNN's backend engine
#   2: the dense-only extras, cudnn-frontend's heuristic pick and its own op, the rejected split kernel
#   3: torch's cuDNN SDPA last (aten's cuDNN attention broke the default RNG under capture)
PASS1 = {"auto", "fa4", "triton_short", "torch_dense", "torch_two_segment", "torch_varlen", "cudnn_fe_backend"}
PASS3 = {"torch_sdpa_cudnn"}


def _serves(lay, cand: str) -> bool:
    """Whether `cand` serves this layout, from the layout's ints (production: BACKENDS[...].serves)."""
    from benchmarks.attention import triton_split
    from benchmarks.attention.extras import equal_lengths
    from encoder_service.ops.attention import BACKENDS

    if cand == "auto":
        return True
    if cand in BACKENDS:
        return BACKENDS[cand].serves(lay["cls"], lay["D"])
    if cand == "triton_split":
        return triton_split.serves(lay["slots"], lay["D"])
    if cand in ("fa4_dense",) or cand.startswith("torch_sdpa_"):
        return equal_lengths(lay["N"], lay["slots"], lay["max_seqlen"]) is not None
    return True


def _expand(lay, cand: str) -> list[str]:
    if not _serves(lay, cand):
        return []
    if cand == "triton_split":
        return [f"triton_split[{c}]" for c in (TRITON_SHORT if lay["max_seqlen"] <= 64 else TRITON_LONG)]
    return [cand]


def display_items(layouts, candidates) -> list[tuple[str, str]]:
    """(layout, candidate) in table order: layout-major, candidates in CANDIDATES order."""
    return [(lay["name"], x) for lay in layouts for c in candidates for x in _expand(lay, c)]


def _pass_of(cand: str) -> int:
    base = cand.split("[")[0]
    return 3 if base in PASS3 else 1 if base in PASS1 else 2


def work_items(layouts, candidates) -> list[tuple[str, str]]:
    """Execution order: pass-major, layout-major within a pass."""
    return sorted(display_items(layouts, candidates), key=lambda it: _pass_of(it[1]))


class Runner:
    """One candidate behind `run(q, k, v, cu, max_seqlen)` with `available()` and `engine()`."""

    def __init__(self, name: str):
        import torch

        from benchmarks.attention import triton_split
        from benchmarks.attention.extras import EXTRAS
        from encoder_service.ops import attention as A

        self.name, self._note = name, ""
        base = name.split("[")[0]
        self._extra = EXTRAS[base]() if base in EXTRAS else None
        self._policy = A.AttentionPolicy("auto")
        self._device = torch.device("cuda")
        if base == "auto":
            self.run = self._auto
            self._needs = "torch"
        elif self._extra is not None:
            self.run = self._extra.run
        elif base == "triton_split":  # rejected, out of the service: triton_split.py
            self.run = partial(triton_split.split_head_attention, config=triton_split.SPLIT_CONFIGS[name[13:-1]])
            self._needs = "triton"
        else:
            self.run, self._needs = A.BACKENDS[base].run, A.BACKENDS[base].needs

    def available(self) -> str:
        if self._extra is not None:
            return self._extra.available()
        return self._policy.missing(self._needs, self._device)

    def _auto(self, q, k, v, cu, max_seqlen):
        self._note = "auto -> " + self._policy.select(q.shape[0], cu.numel() - 1, max_seqlen, q.shape[-1], q.dtype,
                                                      q.device)
        return self._policy.attention(q, k, v, cu, max_seqlen)

    def engine(self) -> str:
        return self._extra.engine() if self._extra is not None else self._note


# ---- worker: runs items here, appends one JSON line per item to the results file -----------------


class LayoutData:
    """Static device buffers (a graph captures their addresses), two random input sets, their references."""

    def __init__(self, lay, seed):
        import torch

        from encoder_service.ops.attention import reference_attention

        n, h, d = lay["N"], lay["H"], lay["D"]
        g = torch.Generator(device="cuda").manual_seed(seed)  # not the default RNG: a candidate may break it
        self.cu = torch.tensor(lay["cu"], dtype=torch.int32, device="cuda")
        self.sets = []
        for _ in range(2):
            qkv = torch.empty(n, 3, h, d, dtype=torch.bfloat16, device="cuda")
            qkv[:, :2].normal_(0.0, 1.5, generator=g)  # scores with std ~2.25: not a flat softmax
            qkv[:, 2].normal_(0.0, 1.0, generator=g)
            self.sets.append(qkv)
        self.q = torch.empty(n, h, d, dtype=torch.bfloat16, device="cuda")
        self.k = torch.empty_like(self.q)
        self.qkv = torch.empty(n, 3, h, d, dtype=torch.bfloat16, device="cuda")
        self.v = self.qkv[:, 2]  # strided, as the towers' v
        self.refs = [reference_attention(s[:, 0], s[:, 1], s[:, 2], self.cu) for s in self.sets]

    def load(self, i):
        self.q.copy_(self.sets[i][:, 0])
        self.k.copy_(self.sets[i][:, 1])
        self.qkv.copy_(self.sets[i])


def compare(out, ref, real_rows: int) -> dict:
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return dict(ok=False, error=f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    o = out.float()
    nan_rows = int(o.isnan().flatten(1).any(1).sum())
    diff = (o - ref).nan_to_num(nan=float("inf"))
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref))
    real = float(torch.linalg.vector_norm(diff[:real_rows]) / torch.linalg.vector_norm(ref[:real_rows]))
    return dict(ok=nan_rows == 0 and math.isfinite(rel) and rel <= REL_TOL, max_abs=float(diff.abs().max()),
                rel_l2=rel, rel_l2_real_rows=real, nan_rows=nan_rows)


def rng_ok() -> tuple[bool, str]:
    import torch

    try:
        torch.rand(16, device="cuda")
        torch.randn(16, device="cuda")
        torch.cuda.synchronize()
        return True, ""
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {str(e)[:200]}"


def time_calls(fn, reps) -> tuple[float, float]:
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return statistics.median(times), min(times)


def run_item(lay, cand: str, data: LayoutData, args) -> dict:
    import torch

    rec = dict(layout=lay["name"], candidate=cand, status="ok", notes=[])
    runner = Runner(cand)
    why = runner.available()
    if why:
        rec.update(status="unavailable", notes=[why])
        return rec
    q, k, v, cu, max_seqlen = data.q, data.k, data.v, data.cu, lay["max_seqlen"]

    def call():
        return runner.run(q, k, v, cu, max_seqlen)

    # eager numerics; the first call includes JIT compiles / graph builds
    data.load(0)
    torch.cuda.empty_cache()  # no other free block of the output's size competes with the poison below
    poison = torch.full((lay["N"], lay["H"], lay["D"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    del poison  # a candidate's torch.empty of this size gets this NaN block back from the caching allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    rec["first_call_s"] = round(time.perf_counter() - t0, 3)
    rec["eager_num"] = compare(out, data.refs[0], lay["real_rows"])
    rec["engine"] = runner.engine()
    del out
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    rec["ms_eager"], rec["ms_eager_min"] = time_calls(call, args.eager_reps)
    # CUDA graph: warm on a side stream, capture, second input set, poisoned output, replay, check, time
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = call()
        torch.cuda.synchronize()
        data.load(1)
        out_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rec["graph_num"] = compare(out_g, data.refs[1], lay["real_rows"])
        graph.replay()
        rec["ms_graph"], rec["ms_graph_min"] = time_calls(graph.replay, args.graph_reps)
        del graph, out_g
    except Exception as e:  # noqa: BLE001
        rec["graph_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rec["notes"].append("graph capture/replay failed")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
    if args.rng_broken_by:
        rec["rng_ok_after"] = None
        rec["notes"].append(f"RNG not checked (broken earlier by {args.rng_broken_by})")
    else:
        rec["rng_ok_after"], why = rng_ok()
        if why:
            rec["notes"].append(f"default CUDA RNG broken after capture: {why}")
    return rec


def env_info() -> dict:
    import torch

    info = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}")
    from importlib.metadata import version

    for dist in ("triton", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels",
                 "apache-tvm-ffi", "nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "cuda-bindings"):
        try:
            info[dist] = version(dist)
        except Exception:  # noqa: BLE001
            info[dist] = None
    return info


def _done(path) -> dict:
    return {(r["layout"], r["candidate"]): r for r in read_records(path)
            if r.get("kind") == "item" and r.get("status") != "started"}


def _fake_worker(args):
    """Harness self-test without a GPU (ATTN_BENCH_FAKE_WORKER=1): synthetic results; the second item
    crashes the worker once (os._exit), ATTN_BENCH_FAKE_CRASH_CAND crashes on every item of a candidate,
    ATTN_BENCH_FAKE_HANG_CAND hangs on them (the driver's stall and skip paths)."""
    items = work_items(select_layouts(args), select_candidates(args))
    done = _done(args.results)
    marker = args.results + ".crashed_once"
    append_record(args.results, dict(kind="env", pid=os.getpid(), fake=True))
    skip = set(filter(None, args.skip.split(",")))
    for i, (ln, cn) in enumerate(items):
        if (ln, cn) in done:
            continue
        base = cn.split("[")[0]
        if base in skip:
            append_record(args.results, dict(kind="item", layout=ln, candidate=cn, status="skipped",
                                             notes=["crashed twice"]))
            continue
        append_record(args.results, dict(kind="item", layout=ln, candidate=cn, status="started"))
        if base == os.environ.get("ATTN_BENCH_FAKE_CRASH_CAND"):
            os._exit(9)
        if base == os.environ.get("ATTN_BENCH_FAKE_HANG_CAND"):
            time.sleep(3600)
        if i == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            print("fake worker: simulated crash", flush=True)
            os._exit(7)
        ms = 1.0 + 0.01 * i
        num = dict(ok=True, max_abs=1e-3, rel_l2=2e-3, rel_l2_real_rows=2e-3, nan_rows=0)
        append_record(args.results, dict(kind="item", layout=ln, candidate=cn, status="ok", notes=[], ms_eager=ms * 1.1,
                                 ms_graph=ms, eager_num=num, graph_num=num, rng_ok_after=True, first_call_s=0.1))
    return 0


def worker_main(args) -> int:
    if os.environ.get("ATTN_BENCH_FAKE_WORKER") == "1":
        return _fake_worker(args)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    torch.backends.cudnn.allow_tf32 = False
    layouts = {lay["name"]: lay for lay in select_layouts(args)}
    items = work_items(list(layouts.values()), select_candidates(args))
    done = _done(args.results)
    append_record(args.results, dict(kind="env", pid=os.getpid(), **env_info()))
    args.rng_broken_by = None
    skip = set(filter(None, args.skip.split(",")))
    data: dict[str, LayoutData] = {}
    with torch.inference_mode():
        for lname, cname in items:
            if (lname, cname) in done:
                continue
            if time.time() > args.deadline:
                break
            lay, base = layouts[lname], cname.split("[")[0]
            if base in skip:
                rec = dict(kind="item", layout=lname, candidate=cname, status="skipped",
                           notes=[f"{base} crashed the worker twice earlier in this run"])
                append_record(args.results, rec)
                done[(lname, cname)] = rec
                continue
            append_record(args.results, dict(kind="item", layout=lname, candidate=cname, status="started",
                                             t=time.time()))
            t0 = time.perf_counter()
            try:
                if lname not in data:
                    data.clear()  # one layout's buffers at a time
                    torch.cuda.empty_cache()
                    data[lname] = LayoutData(lay, seed=sum(map(ord, lname)))
                rec = run_item(lay, cname, data[lname], args)
            except Exception as e:  # noqa: BLE001
                rec = dict(layout=lname, candidate=cname, status="error",
                           notes=[f"{type(e).__name__}: {str(e)[:400]}"], traceback=traceback.format_exc()[-2000:])
            rec.update(kind="item", wall_s=round(time.perf_counter() - t0, 2))
            append_record(args.results, rec)
            done[(lname, cname)] = rec
            try:  # a sticky CUDA error poisons this process: the driver starts a fresh worker
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                append_record(args.results, dict(kind="note", text=f"CUDA context unusable after {lname}/{cname}: {e}"))
                sys.exit(3)
            if rec.get("rng_ok_after") is False:
                args.rng_broken_by = cname
                rest = [it for it in items if it not in done and it[1].split("[")[0] != base]
                if rest:
                    append_record(args.results,
                                  dict(kind="note", text=f"default RNG broken by {lname}/{cname}: new worker"))
                    sys.exit(4)  # a fresh process has a fresh default RNG for the other candidates
    return 0


# ---- driver: restarts workers, aggregates, writes the table --------------------------------------


def select_layouts(args) -> list[dict]:
    layouts = build_layouts()
    if args.layouts:
        want = args.layouts.split(",")
        unknown = set(want) - {lay["name"] for lay in layouts}
        if unknown:
            raise SystemExit(f"unknown layouts: {sorted(unknown)} (known: {[lay['name'] for lay in layouts]})")
        layouts = [lay for lay in layouts if lay["name"] in want]
    return layouts


def select_candidates(args) -> list[str]:
    if not args.candidates:
        return list(CANDIDATES)
    want = args.candidates.split(",")
    unknown = set(want) - set(CANDIDATES)
    if unknown:
        raise SystemExit(f"unknown candidates: {sorted(unknown)} (known: {CANDIDATES})")
    return want


def _fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def _passed(r) -> bool:
    return (r.get("status") == "ok" and r.get("ms_graph") is not None and (r.get("eager_num") or {}).get("ok")
            and (r.get("graph_num") or {}).get("ok") and r.get("rng_ok_after", True) is not False)


def render(layouts, items, recs, wall_s) -> tuple[str, dict, dict]:
    final, started = {}, set()
    for r in recs:
        if r.get("kind") == "item":
            key = (r["layout"], r["candidate"])
            if r.get("status") == "started":
                started.add(key)
            else:
                final[key] = r
    by_name = {lay["name"]: lay for lay in layouts}
    env = next((r for r in recs if r.get("kind") == "env"), None)
    lines = []
    if env:
        lines += ["env: " + ", ".join(f"{k}={v}" for k, v in env.items() if k not in ("kind", "pid")), ""]
    lines += ["| layout | candidate | ms eager | ms graph | TFLOP/s | rel err | notes |",
              "|---|---|---|---|---|---|---|"]
    for lname, cname in items:
        r = final.get((lname, cname)) or dict(
            status="crashed/hung" if (lname, cname) in started else "not run (time budget)")
        num_e, num_g = r.get("eager_num") or {}, r.get("graph_num") or {}
        notes = list(r.get("notes", []))
        if r.get("status") != "ok":
            notes.insert(0, r.get("status"))
        else:
            if not num_e.get("ok"):
                notes.append(f"EAGER NUMERICS FAIL (rel {num_e.get('rel_l2')}, nan rows {num_e.get('nan_rows')})")
            if "graph_num" in r and not num_g.get("ok"):
                notes.append(f"GRAPH NUMERICS FAIL (rel {num_g.get('rel_l2')}, nan rows {num_g.get('nan_rows')})")
            if r.get("graph_error"):
                notes.append(r["graph_error"][:160])
            if r.get("engine"):
                notes.append(r["engine"])
            if (r.get("first_call_s") or 0) > 1.0:
                notes.append(f"first call {r['first_call_s']} s")
            notes.append(f"max abs {_fmt(num_g.get('max_abs', num_e.get('max_abs')), 4)}")
        ms = r.get("ms_graph") if r.get("ms_graph") is not None else r.get("ms_eager")
        tflops = by_name[lname]["flops"] / (ms * 1e-3) / 1e12 if ms else None
        rel = num_g.get("rel_l2", num_e.get("rel_l2"))
        lines.append(f"| {lname} | {cname} | {_fmt(r.get('ms_eager'))} | {_fmt(r.get('ms_graph'))} | {_fmt(tflops, 0)} "
                     f"| {'-' if rel is None else f'{rel:.2e}'} | {'; '.join(str(n) for n in notes)} |")
    winners, production = {}, set(PRODUCTION) - {"auto"}
    lines += ["", "Best per layout (numerics pass eager and in the graph, captured, RNG intact; by graph ms):", "",
              "| layout | class | D | rows | segments (slots) | max_seqlen | best | ms graph "
              "| best the service can run | ms graph | auto ran | ms graph |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lay in layouts:
        ranked = sorted(((c, r["ms_graph"]) for (ln, c), r in final.items() if ln == lay["name"] and _passed(r)),
                        key=lambda x: x[1])
        prod = [x for x in ranked if x[0].split("[")[0] in production]
        auto = final.get((lay["name"], "auto"), {})
        winners[lay["name"]] = dict(best=ranked[0] if ranked else None, production=prod[0] if prod else None,
                                    auto=(auto.get("engine"), auto.get("ms_graph")))
        best = f"{ranked[0][0]} | {ranked[0][1]:.3f}" if ranked else "- | -"
        bp = f"{prod[0][0]} | {prod[0][1]:.3f}" if prod else "- | -"
        lines.append(f"| {lay['name']} | {lay['cls']} | {lay['D']} | {lay['N']} | {lay['segments']} ({lay['slots']}) "
                     f"| {lay['max_seqlen']} | {best} | {bp} | {auto.get('engine') or '-'} "
                     f"| {_fmt(auto.get('ms_graph'))} |")
    lines += ["", "Per layout class and head dim (ops/attention.py TABLE): production backends "
              "that passed on EVERY measured layout of the class, by total graph ms:", ""]
    classes: dict[tuple, list] = {}
    for lay in layouts:
        classes.setdefault((lay["cls"], lay["D"]), []).append(lay["name"])
    for (cls, d), names in sorted(classes.items()):
        totals = {}
        for cand in {c for (ln, c) in final if ln in names and c.split("[")[0] in production}:
            rs = [final.get((ln, cand)) for ln in names]
            if all(r is not None and _passed(r) for r in rs):
                totals[cand] = sum(r["ms_graph"] for r in rs)
        ranked = ", ".join(f"{c} {ms:.3f}" for c, ms in sorted(totals.items(), key=lambda x: x[1])) or "-"
        lines.append(f"- {cls}, D={d} ({', '.join(names)}): {ranked}")
    lines += ["", "Layouts: " + "; ".join(f"{lay['name']}: {lay['desc']}" for lay in layouts),
              "TFLOP/s = 4 * sum(len^2) * D * H / time (graph time when captured; dummy segments count: they are "
              "computed). Dense-only candidates (fa4_dense, torch_sdpa_*) run only on equal-length layouts.",
              f"Total wall time {wall_s:.1f} s."]
    return "\n".join(lines), final, winners


def driver_main(args) -> int:
    out = out_dir()
    results = str(out / "attention_candidates.jsonl")
    if os.path.exists(results) and not args.resume:
        os.remove(results)
    log_path = out / "attention_candidates_worker.log"
    t_start = time.time()
    deadline = t_start + args.budget_s
    layouts, candidates = select_layouts(args), select_candidates(args)
    items = work_items(layouts, candidates)
    print(f"[bench] {len(items)} items over {len(layouts)} layouts; budget {args.budget_s:.0f} s; -> {out}",
          flush=True)
    restarts = 0
    while True:
        recs = read_records(results)
        finished = {(r["layout"], r["candidate"]) for r in recs if r.get("kind") == "item" and r["status"] != "started"}
        if all(it in finished for it in items) or time.time() > deadline - 5 or restarts > args.max_restarts:
            break
        crashes: dict[str, int] = {}
        for r in recs:
            if r.get("kind") == "item" and r.get("status") in ("crashed", "hung/killed"):
                base = r["candidate"].split("[")[0]
                crashes[base] = crashes.get(base, 0) + 1
        cmd = module_command("benchmarks.attention.candidates", "--worker", "--results", results, "--deadline",
                             str(deadline - 10), "--eager-reps", str(args.eager_reps), "--graph-reps",
                             str(args.graph_reps), "--skip", ",".join(sorted(b for b, n in crashes.items() if n >= 2)),
                             "--layouts", args.layouts, "--candidates", args.candidates)
        with open(log_path, "a") as log:
            log.write(f"\n==== worker start {time.strftime('%H:%M:%S')} (restart {restarts}) ====\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=module_env())
            start_size = os.path.getsize(results) if os.path.exists(results) else 0
            last_size, last_change, why = start_size, time.time(), None
            while proc.poll() is None:
                time.sleep(0.5)
                size = os.path.getsize(results) if os.path.exists(results) else 0
                if size != last_size:
                    last_size, last_change = size, time.time()
                    print_progress(results)
                # silent past --stall-s (a worker that has written nothing yet gets STARTUP_S to import torch)
                if time.time() - last_change > (args.stall_s if size != start_size else max(args.stall_s, STARTUP_S)):
                    why = f"silent for {args.stall_s:.0f} s"
                elif time.time() > deadline:
                    why = "time budget"
                if why:
                    proc.kill()
                    proc.wait()
                    log.write(f"==== killed: {why} ====\n")
                    break
        rc = proc.returncode
        recs = read_records(results)
        pending = None  # an item that started but never finished: crashed or hung
        for r in recs:
            if r.get("kind") == "item":
                key = (r["layout"], r["candidate"])
                pending = key if r["status"] == "started" else (None if key == pending else pending)
        if pending is not None:
            tail = log_path.read_text()[-1500:] if log_path.exists() else ""
            notes = [f"worker exit {rc}" + (f" ({why})" if why else ""), tail[-300:].replace("\n", " | ")]
            append_record(results, dict(kind="item", layout=pending[0], candidate=pending[1],
                                status="hung/killed" if why else "crashed", notes=notes))
        print_progress(results)
        if rc == 0 or why == "time budget":
            break
        restarts += 1
        print(f"[bench] worker exited rc={rc}{f' ({why})' if why else ''}; restarting ({restarts})", flush=True)
    wall_s = time.time() - t_start
    recs = read_records(results)
    text, final, winners = render(layouts, display_items(layouts, candidates), recs, wall_s)
    print("\n" + text, flush=True)
    summary = dict(env=next((r for r in recs if r.get("kind") == "env"), None),
                   layouts=[{k: v for k, v in lay.items() if k != "cu" or len(v) <= 64} for lay in layouts],
                   results=[final[k] for k in items if k in final], winners=winners, wall_s=round(wall_s, 1),
                   worker_restarts=restarts)
    write_result("attention_candidates", stamp(), summary, text + "\n")
    return 0


_printed: set = set()


def print_progress(results):
    for r in read_records(results):
        if r.get("kind") != "item" or r["status"] == "started":
            continue
        key = (r["layout"], r["candidate"])
        if key in _printed:
            continue
        _printed.add(key)
        num = r.get("graph_num") or r.get("eager_num") or {}
        print(f"[bench] {r['layout']:>22} {r['candidate']:<26} {r['status']:<12} eager {_fmt(r.get('ms_eager'))} "
              f"graph {_fmt(r.get('ms_graph'))} rel {num.get('rel_l2')} "
              f"{'; '.join(str(n) for n in r.get('notes', []))[:200]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="", help="comma list (default: all; --list shows them)")
    ap.add_argument("--candidates", default="", help=f"comma list of {CANDIDATES} (default: all)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="whole-run budget: no item starts after it, a worker still running is killed (330)")
    ap.add_argument("--stall-s", type=float, default=90.0, help="kill a worker that writes nothing this long (90)")
    ap.add_argument("--max-restarts", type=int, default=10)
    ap.add_argument("--eager-reps", type=int, default=20)
    ap.add_argument("--graph-reps", type=int, default=30)
    ap.add_argument("--resume", action="store_true",
                    help="keep $OUT/attention_candidates.jsonl, skip finished items")
    ap.add_argument("--list", action="store_true", help="print the layouts and the work items (no GPU)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.list:
        layouts = select_layouts(args)
        for lay in layouts:
            print(f"{lay['name']:>22}: {lay['cls']:<13} D={lay['D']} N={lay['N']} segments={lay['segments']} "
                  f"slots={lay['slots']} max_seqlen={lay['max_seqlen']} GFLOP={lay['flops'] / 1e9:.1f}  {lay['desc']}")
        items = work_items(layouts, select_candidates(args))
        print(f"{len(items)} work items, in execution order:")
        for lname, cname in items:
            print(f"  pass {_pass_of(cname)}  {lname:<22} {cname}")
        return 0
    if args.worker:
        return worker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
