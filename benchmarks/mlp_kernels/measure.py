"""What the sections measure with: numerics against a float32 reference, and timing of one call replayed in a
CUDA graph."""

from __future__ import annotations

import math
import statistics
import time

import torch

REL_TOL = 2e-2  # ||out - ref|| / ||ref|| against float32 (bf16 GEMMs land near 3e-3, attention near 5e-3)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """ok: same shape, no NaN (an element not written stays NaN: outputs are poisoned first), relative L2
    error against the float32 reference <= REL_TOL."""
    if tuple(out.shape) != tuple(ref.shape):
        return dict(ok=False, error=f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    o = out.float()
    nan = int(o.isnan().sum())
    diff = (o - ref).nan_to_num(nan=float("inf"))
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
    return dict(ok=nan == 0 and math.isfinite(rel) and rel <= REL_TOL, rel_l2=rel, nan=nan,
                max_abs=float(diff.abs().max()))


def time_replays(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median ms of `reps` replays, each between its own pair of CUDA events (GPU time, no host work)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    graph.replay()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def bench_call(call, load, refs, reps: int = 30) -> dict:
    """A kernel call `call() -> out` on static input buffers that `load(i)` fills with input set i (0, 1),
    `refs[i]` its float32 reference. Eager numerics (first call: JIT included), then captured in a CUDA graph,
    input set 1 loaded, the graph's output poisoned with NaN, replayed, numerics again (the graph reads the
    live buffers and writes every element), then the median of replays."""
    rec: dict = {}
    load(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    rec["first_call_s"] = round(time.perf_counter() - t0, 3)
    rec["eager"] = compare(out, refs[0])
    del out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    load(1)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    rec["graph"] = compare(out, refs[1])
    rec["ms"] = time_replays(graph, reps)
    rec["ok"] = bool(rec["eager"]["ok"] and rec["graph"]["ok"])
    del graph, out
    return rec
