"""Whole towers at real size (random weights, bench_vit.py's build: transformers' model saved and loaded by our
loader), bf16, through GraphRunner, once per variant (its own capture), against transformers:

  Qwen2.5-VL-7B  1080p (exact 10764 graph) and 8 x 448x448 (multi graph of the 8192 bucket)
  Qwen3-VL-8B    720p (exact 3520) and 1080p (exact 8160)

A variant is an MLP kernel choice (ops/mlp_kernels.py: "auto", the service's; "split" / "cublaslt", the path
before issue 23: every form's fallback) or "attn:<candidate>": a candidate of the kernels section standing in
for FA4 at head dim 72 (attention.BACKENDS["fa4"] replaced for the variant; the policy's startup check runs
on it; layouts it cannot serve keep FA4), the MLPs on auto.

Per case: median GPU ms of one graph replay, median wall ms of runner.encode (synchronized), and the norm
relative error of every output level against transformers in float32 on the same weights, beside
transformers' own bf16 run's (gpu_parity.py's rule: ours <= 1.1 x transformers', or within 1e-2 of transformers
in the same dtype). Which MLP kernel served each form and which were demoted by their startup check is
recorded (a demoted kernel means the variant ran the next one).
`small`: tiny towers in float32 on the CPU, static-buffer graphs (the script's --small smoke test).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

FAMILIES = {
    "qwen2_5_vl": dict(name="Qwen2.5-VL-7B", cases={"1080p": [(1920, 1080)], "8 x 448x448": [(448, 448)] * 8},
                       buckets=[8192], exact=[10764]),
    # 14400: the multi graph four 720p images fill (the service's batches at concurrency 64; service.py)
    "qwen3_vl": dict(name="Qwen3-VL-8B", cases={"720p": [(1280, 720)], "1080p": [(1920, 1080)]},
                     buckets=[], exact=[3520, 8160, 14400]),
}
SMALL = dict(cases={"112x112": [(112, 112)], "4 x 112x112": [(112, 112)] * 4}, buckets=[256], exact=[])


class Family:
    """One family built once: our loaded model, transformers' bf16 and float32 outputs per case."""

    def __init__(self, family: str, small: bool = False):
        from benchmarks.common.models import REAL, SMALL as SMALL_VISION, build_reference, patch_grid, reference_rows
        from encoder_service.models.loader import load_model

        self.family, self.spec = family, FAMILIES[family] | (SMALL if small else {})
        vision = (SMALL_VISION if small else REAL)[family]
        device, dtype = (torch.device("cpu"), torch.float32) if small else (torch.device("cuda"), torch.bfloat16)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            reference = build_reference(family, vision, device, dtype, Path(tmp))
            self.loaded = load_model(tmp, device=device, dtype=dtype)
        reference32 = copy.deepcopy(reference).float()
        self.cases = {}
        with torch.inference_mode():
            for case, sizes in self.spec["cases"].items():
                grids = [patch_grid(w, h, vision["patch_size"]) for w, h in sizes]
                gen = torch.Generator().manual_seed(1)
                pvs = [torch.randn(t * h * w, self.loaded.spec.patch_dim, generator=gen).to(device, dtype)
                       for t, h, w in grids]
                flat, grid_tensor = torch.cat(pvs), torch.tensor(grids, device=device)
                self.cases[case] = dict(grids=grids, pvs=pvs,
                                        ref=reference_rows(reference(flat, grid_thw=grid_tensor)).float(),
                                        ref32=reference_rows(reference32(flat.float(), grid_thw=grid_tensor)))
        del reference, reference32
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.build_s = time.perf_counter() - t0

    def levels(self, rows: torch.Tensor) -> list[torch.Tensor]:
        width = self.loaded.spec.out_hidden_size
        return [rows[:, s : s + width] for s in range(0, rows.shape[1], width)]


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@contextmanager
def attention_variant(name: str):
    """BACKENDS["fa4"] serves head dim 72 with kernels.py's candidate `name` while inside (dense candidates
    only where the layout is one segment); "fa4": unchanged."""
    from benchmarks.mlp_kernels.kernels import attention_call
    from encoder_service.ops import attention

    if name == "fa4":
        yield
        return
    original = attention.BACKENDS["fa4"]
    candidate = attention_call(name, 72)
    one_segment_only = name in ("fa4_dense", "cudnn_dense")

    def run(q, k, v, cu, max_seqlen):
        if q.shape[-1] != 72 or (one_segment_only and not (cu.numel() == 2 and max_seqlen >= q.shape[0])):
            return original.run(q, k, v, cu, max_seqlen)
        return candidate(q, k, v, cu, max_seqlen)

    attention.BACKENDS["fa4"] = dataclasses.replace(original, run=run)
    try:
        yield
    finally:
        attention.BACKENDS["fa4"] = original


def run_variant(fam: Family, variant: str, keep: bool = False) -> tuple[list[dict], object]:
    """One record per case for this variant; the runner too when `keep` (else freed)."""
    from benchmarks.bench_vit import replay_ms, time_call

    from encoder_service.ops import mlp_kernels
    from encoder_service.runtime.graphs import GraphRunner

    attn = variant.removeprefix("attn:") if variant.startswith("attn:") else "fa4"
    policy = mlp_kernels.MlpKernelPolicy("auto" if variant.startswith("attn:") else variant)
    recs = []
    with attention_variant(attn), mlp_kernels.use_policy(policy), torch.inference_mode():
        t0 = time.perf_counter()
        runner = GraphRunner(fam.loaded, buckets=fam.spec["buckets"], exact_buckets=fam.spec["exact"],
                             capture=True, eager_min_patches=None, attention="auto")  # no capture on the CPU
        capture_s = time.perf_counter() - t0
        for case, c in fam.cases.items():
            rows = torch.cat(runner.encode(c["pvs"], c["grids"])).float()
            plan = runner.plan(c["grids"])
            rec = dict(family=fam.family, model=fam.spec["name"], case=case, variant=variant,
                       patches=sum(t * h * w for t, h, w in c["grids"]), capture_s=round(capture_s, 1),
                       graphs=[f"{b.bucket}/{g.kind if g else 'eager'}" for b, g in plan])
            if len(plan) == 1 and plan[0][1] is not None and plan[0][1].graph is not None:
                rec["replay_ms"] = replay_ms(plan[0][1], runner.device)
            rec["encode_ms"], _ = time_call(lambda c=c: runner.encode(c["pvs"], c["grids"]), runner.device, 5, 50, 1.0)
            ours = [norm_rel(o, r) for o, r in zip(fam.levels(rows), fam.levels(c["ref32"]))]
            theirs = [norm_rel(o, r) for o, r in zip(fam.levels(c["ref"]), fam.levels(c["ref32"]))]
            rec["ours_vs_fp32"], rec["transformers_bf16_vs_fp32"] = max(ours), max(theirs)
            same = [norm_rel(o, r) for o, r in zip(fam.levels(rows), fam.levels(c["ref"]))]
            rec["vs_transformers_same_dtype"] = max(same)
            rec["parity_ok"] = all(o <= 1.1 * t or d <= 1e-2 for o, t, d in zip(ours, theirs, same))
            rec["mlp_policy"] = policy.describe()
            rec["attention"] = runner.attention.describe()
            recs.append(rec)
    if keep:
        return recs, runner
    runner = None  # its graphs and pool go before the next variant captures (graphs refer back to it: a cycle)
    gc.collect()
    if fam.loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    return recs, runner
