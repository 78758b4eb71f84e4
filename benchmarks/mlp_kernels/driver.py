"""The MLP kernels benchmark (issue 23) on one H100 in one bounded run (~7 min): the MLP kernels `auto` now
picks (quack's GEMMs with the activation in the epilogue) against the path before issue 23, end to end against
transformers; where the service loses Qwen3's throughput, with rowpath/host_pool.py's fix on and off; and
bench_vit's rows of the README table. Installs nothing: it imports what scripts/gpu/install_wheels.sh put in
/tmp/site-packages (FA4, CuTe DSL, quack-kernels) and, for the engine, the service's wheels (scripts/gpu/env.sh:
PyAV); what is missing is reported "unavailable" with what to carry.

Four sections, each in its own process, one after the other (benchmarks/mlp_kernels/: what each measures, and
how):
  kernels   per kernel against float32, CUDA graphs: the kernels not measured yet (Qwen2's fc1 + quick_gelu:
            cuBLAS + torch vs quack); --sweep: every candidate of the first run too (Qwen2.5's gate/up + SwiGLU
            per Triton / quack tile config and torch.compile, Qwen3's fc1 + GELU, RMSNorm, attention at D 72
            / 80 with FA4's tile configs, zero-padding, cuDNN)
  e2e_q25   Qwen2.5-VL-7B 1080p and 8 x 448x448 through GraphRunner: MLP kernels "split" (before: cuBLAS +
            silu_mul) and "auto" (quack's SwiGLU GEMM), each against transformers fp32 and bf16
  e2e_q3    Qwen3-VL-8B 720p and 1080p: "cublaslt" (before: cuBLASLt's GELU epilogue) and "auto" (quack's
            GELU GEMM), plus the fastest D-72 attention candidate if a --sweep found one beating FA4; then the
            service diagnostics on the auto runner (host copies of the rows into torch's allocator and into
            the pool, runner alone, the engine in a closed loop of 64 callers: preprocessing on the GPU / CPU /
            none, rows into torch's allocator or the pool, every image's rows kept or a cache at capacity)
  readme    bench_vit for the README's table (transformers, ours with FA4 + quack, ours with torch's
            attention and no quack: what runs without the [fa4] extra), one process per family, each in its
            own folder ($OUT/readme_<family>/bench_vit.md and its JSON)
A worker that crashes (illegal address, abort) or passes its deadline is replaced and goes on after the
item it was running (recorded "crashed"); items past the time budget are reported "not run".

    source scripts/gpu/env.sh && PYTHONPATH=/tmp/site-packages:$PYTHONPATH BENCH_COMMIT=<commit> \
        python3 -m benchmarks.mlp_kernels                                         # GPU, ~7 min
    python3 -m benchmarks.mlp_kernels --list                                       # the items; no GPU
    python3 -m benchmarks.mlp_kernels --small --sections e2e_q25,e2e_q3,readme    # CPU smoke test (~2 min)
    ... --sections kernels --sweep --budget-s 200
    OUT=/tmp/mlp_kernels ... --resume        # go on after a run cut short (the records under OUT are kept)

Writes $OUT/mlp_kernels.{md,json,jsonl} and one log per worker (OUT defaults to ./gpu_out); prints a short
table last. Exit status 0 unless the driver itself fails (wrong numerics are reported, not fatal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common.children import module_command, module_env
from benchmarks.common.report import append_record, commit, read_records

SECTIONS = ("kernels", "e2e_q25", "e2e_q3", "readme")
SHARE = {"kernels": 0.08, "e2e_q25": 0.17, "e2e_q3": 0.32, "readme": 0.43}  # of the time left when it starts
SWEEP_SHARE = 0.42  # kernels' share with --sweep (the first run's: 193 s of 460)
E2E_VARIANTS = {"e2e_q25": ["split", "auto"], "e2e_q3": ["cublaslt", "auto"]}  # before, after (mlp_kernels choices)
README_CASES = {"qwen2_5_vl": ["448x448", "1080p", "8 x 448x448"], "qwen3_vl": ["720p", "1080p"]}
RESTARTS = 3
GRACE_S = 20.0


# ---- workers --------------------------------------------------------------------------------------------


def finished_items(path: str) -> set[str]:
    """Items with a result (or marked crashed by the driver): a restarted worker skips them."""
    return {r["item"] for r in read_records(path) if r.get("kind") == "item"}


def env_info() -> dict:
    from importlib.metadata import version

    info = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}")
    for dist in ("triton", "transformers", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "apache-tvm-ffi"):
        try:
            info[dist] = version(dist)
        except Exception:  # noqa: BLE001 - not installed
            info[dist] = None
    info["commit"] = commit()  # $BENCH_COMMIT on the device: its copy's git metadata is not the tree's
    return info


def worker_items(section: str, args) -> list[str]:
    from benchmarks.mlp_kernels import kernels, service

    if section == "kernels":
        return kernels.items(args.sweep)
    if section == "e2e_q25":
        return [f"e2e/qwen2_5_vl/{v}" for v in json.loads(args.variants)]
    return ([f"e2e/qwen3_vl/{v}" for v in json.loads(args.variants)]
            + ["service/host_copy", "service/runner_alone"]
            + [f"service/engine[{v}]" for v in service.ENGINE_VARIANTS])


def worker_main(args) -> int:
    if os.environ.get("MLP_KERNELS_FAKE_WORKER") == "1":
        return fake_worker(args)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references stay float32
    torch.backends.cudnn.allow_tf32 = False
    if not any(r.get("kind") == "env" for r in read_records(args.results)):  # the run's first worker
        append_record(args.results, dict(kind="env", **env_info()))
    done = finished_items(args.results)
    state: dict = {}
    for item in worker_items(args.worker, args):
        if item in done:
            continue
        if time.time() > args.deadline:
            break
        append_record(args.results, dict(kind="start", item=item, t=time.time()))
        t0 = time.perf_counter()
        try:
            rec = run_worker_item(args.worker, item, state, args.small)
        except torch.cuda.OutOfMemoryError as e:
            rec = dict(status="error", error=f"OOM: {str(e)[:300]}")
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - recorded; the next item runs
            rec = dict(status="error", error=f"{type(e).__name__}: {str(e)[:400]}",
                       traceback=traceback.format_exc()[-3000:])
        append_record(args.results, dict(kind="item", item=item, wall_s=round(time.perf_counter() - t0, 2), **rec))
        try:  # a sticky CUDA error poisons this process: the driver starts a fresh worker
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            append_record(args.results, dict(kind="note", text=f"CUDA context unusable after {item}: {e}"))
            return 3
    return 0


def run_worker_item(section: str, item: str, state: dict, small: bool) -> dict:
    from benchmarks.mlp_kernels import e2e, kernels, service

    if section == "kernels":
        if small or not torch.cuda.is_available():
            return dict(status="unavailable", why="needs CUDA")
        with torch.no_grad():
            return kernels.run_item(item)
    family = "qwen2_5_vl" if section == "e2e_q25" else "qwen3_vl"
    if "family" not in state:
        state["family"] = e2e.Family(family, small)
        state["build_s"] = round(state["family"].build_s, 1)
    fam = state["family"]
    if item.startswith("e2e/"):
        variant = item.split("/", 2)[2]
        keep = section == "e2e_q3" and variant == "auto"  # the service's runner serves the diagnostics
        cases, runner = e2e.run_variant(fam, variant, keep=keep)
        if runner is not None:
            state["runner"] = runner
        return dict(status="ok", cases=cases, build_s=state["build_s"])
    if "runner" not in state:  # a worker started after a crash: the auto runner again (its records dropped)
        state["runner"] = e2e.run_variant(fam, "auto", keep=True)[1]
    runner = state["runner"]
    c = next(iter(fam.cases.values()))  # 720p (--small: 112x112)
    pvs, grid = c["pvs"][0], c["grids"][0]
    if item == "service/host_copy":
        if runner.device.type != "cuda":
            return dict(status="unavailable", why="needs CUDA")
        return dict(status="ok", **service.host_copy_item(runner, pvs, grid))
    if item == "service/runner_alone":
        return dict(status="ok", **service.runner_alone(runner, pvs, grid))
    why = service.missing_service_wheels()
    if why:
        return dict(status="unavailable", why=why)
    variant = item[len("service/engine[") : -1]
    if "jpegs" not in state:  # the same distinct JPEGs for every variant (the engine caches nothing)
        state["jpegs"] = (service.distinct_jpegs(24, 5_000_000, size=(320, 240)) if small
                          else service.distinct_jpegs(service.IMAGES, 5_000_000))
    if small:  # small images, a short loop
        return dict(status="ok", **service.engine_run(runner, variant, state["jpegs"], fam.loaded, concurrency=8,
                                                      warmup=4, window=8))
    return dict(status="ok", **service.engine_run(runner, variant, state["jpegs"], fam.loaded))


def fake_worker(args) -> int:
    """Harness self-test without a GPU (MLP_KERNELS_FAKE_WORKER=1, benchmarks/tests/test_mlp_kernels.py): synthetic
    records in the real shapes; the third kernels item kills the worker once (the driver's restart path)."""
    marker = args.results + ".crashed_once"
    for n, item in enumerate(i for i in worker_items(args.worker, args) if i not in finished_items(args.results)):
        append_record(args.results, dict(kind="start", item=item, t=time.time()))
        if args.worker == "kernels" and n == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(7)
        ms = 1.0 + (sum(map(ord, item)) % 97) / 100
        num = dict(ok=True, rel_l2=3e-3, nan=0, max_abs=1e-2)
        rec = dict(status="ok", ok=True, ms=ms, eager=num, graph=num, first_call_s=0.1)
        if item.startswith("e2e/"):
            family, variant = item.split("/")[1:]
            rec = dict(status="ok", cases=[dict(family=family, model=family, case="1080p", variant=variant, patches=1,
                                               graphs=["8160/exact"], replay_ms=ms, encode_ms=ms + 0.1,
                                               ours_vs_fp32=0.01, transformers_bf16_vs_fp32=0.011, parity_ok=True,
                                               mlp_policy=dict(selected={"swiglu/cuda/E1280/I3456/bfloat16": "quack"},
                                                               demoted={}),
                                               attention={"selected": {"one/D72/bfloat16": "fa4"}})])
        elif item.startswith("service/"):
            rec = dict(status="error", error="fake worker")
        append_record(args.results, dict(kind="item", item=item, **rec))
    return 0


# ---- driver ---------------------------------------------------------------------------------------------


def run_section(section: str, args, deadline: float, variants: list[str]) -> None:
    """Run the section's worker until its items are done, restarting it after a crash or a hang."""
    log = open(Path(args.out) / f"mlp_kernels_{section}.log", "a")
    for attempt in range(RESTARTS + 1):
        cmd = module_command("benchmarks.mlp_kernels", "--worker", section, "--results", args.results,
                             "--deadline", str(deadline), "--variants", json.dumps(variants),
                             *(["--small"] if args.small else []), *(["--sweep"] if args.sweep else []))
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=module_env())
        rc = _wait(proc, deadline - started + GRACE_S)
        recs = read_records(args.results)
        done = {r["item"] for r in recs if r.get("kind") == "item"}
        running = [r["item"] for r in recs if r.get("kind") == "start" and r["item"] not in done]
        print(f"[{section}] worker attempt {attempt + 1} exit {rc}; {len(done)} items recorded", flush=True)
        if rc == 0:
            return
        for item in running:  # the item the worker died in: recorded, the next worker goes on after it
            append_record(args.results, dict(kind="item", item=item, status="crashed", error=f"worker exit {rc}"))
        if time.time() > deadline:
            return


def _wait(proc: subprocess.Popen, timeout_s: float):
    """The process's exit status, or a note after killing its process group at the timeout."""
    try:
        return proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return "killed at the time budget"


def run_readme(args, deadline: float) -> None:
    """bench_vit once per family (its README cases, --attention auto,torch), each into its own folder;
    one record per family: the process's exit and its markdown. The second gets what the first left."""
    families = list(README_CASES)
    for n, family in enumerate(families):
        item = f"readme/{family}"
        if item in finished_items(args.results):
            continue
        out = Path(args.out) / f"readme_{family}"
        out.mkdir(parents=True, exist_ok=True)
        cmd = module_command("benchmarks.bench_vit", "--family", family, "--attention", "auto,torch",
                             *(["--small"] if args.small else [arg for case in README_CASES[family]
                                                               for arg in ("--case", case)]))
        left = deadline - time.time()
        append_record(args.results, dict(kind="start", item=item, t=time.time()))
        with open(out / "bench_vit.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=module_env(dict(os.environ, OUT=str(out))))
            rc = _wait(proc, left / (len(families) - n))
        md = out / "bench_vit.md"
        rec = dict(status="ok" if rc == 0 else "error", exit=rc, folder=str(out),
                   markdown=md.read_text() if md.exists() else None)
        if rc != 0:
            rec["error"] = f"bench_vit exit {rc}; its log: {out / 'bench_vit.log'}"
        append_record(args.results, dict(kind="item", item=item, **rec))
        print(f"[readme] {family}: exit {rc}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mlp_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=470.0, help="whole run (default %(default)s)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--list", action="store_true", help="print the items and exit (no GPU)")
    parser.add_argument("--resume", action="store_true",
                        help="keep $OUT/mlp_kernels.jsonl of an earlier run: its recorded items are not run again")
    parser.add_argument("--small", action="store_true",
                        help="CPU smoke test: tiny towers in float32 (the kernels section needs CUDA)")
    parser.add_argument("--sweep", action="store_true",
                        help="the kernels section runs every candidate (the first run's sweep), not only the new ones")
    parser.add_argument("--worker", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default="[]", help=argparse.SUPPRESS)  # a JSON list (names hold commas)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
    if args.list:
        from benchmarks.mlp_kernels import kernels, service

        print("\n".join(kernels.items(args.sweep)))
        for section, variants in E2E_VARIANTS.items():
            family = "qwen2_5_vl" if section == "e2e_q25" else "qwen3_vl"
            print("\n".join(f"e2e/{family}/{v}" for v in variants))
        print("e2e/qwen3_vl/attn:<fastest D72 candidate of a --sweep, if it beats fa4>")
        print("\n".join(["service/host_copy", "service/runner_alone"]
                        + [f"service/engine[{v}]" for v in service.ENGINE_VARIANTS]))
        print("\n".join(f"readme/{family}: bench_vit {' '.join(cases)}" for family, cases in README_CASES.items()))
        return 0
    from benchmarks.mlp_kernels import report

    args.out = os.environ.get("OUT", "gpu_out")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.results = str(Path(args.out) / "mlp_kernels.jsonl")
    if os.path.exists(args.results) and not args.resume:
        os.remove(args.results)
    start = time.time()
    end = start + args.budget_s
    share = dict(SHARE, kernels=SWEEP_SHARE) if args.sweep else SHARE
    for i, section in enumerate(sections):
        deadline = time.time() + (end - time.time()) * share[section] / sum(share[s] for s in sections[i:])
        variants = list(E2E_VARIANTS.get(section, []))
        picked = report.choices(report.final_records(read_records(args.results)))
        if section == "e2e_q3" and picked.get("attention_72"):
            variants.append(f"attn:{picked['attention_72']}")
        print(f"[{section}] until +{deadline - start:.0f} s; variants: {', '.join(variants) or '-'}", flush=True)
        if section == "readme":
            run_readme(args, deadline)
        else:
            run_section(section, args, deadline, variants)
    md, summary, short = report.render(read_records(args.results), time.time() - start)
    (Path(args.out) / "mlp_kernels.md").write_text(md)
    (Path(args.out) / "mlp_kernels.json").write_text(json.dumps(summary, indent=2, default=str))
    print(short)
    return 0
