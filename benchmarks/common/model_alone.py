"""The model alone: the one reference of every "% of the model" a benchmark reports (load_bench, ipc_bench,
scale_out).

The runner the service built (`core.runner`: a GraphRunner with the service's CUDA graphs on a GPU, an
EagerRunner on the CPU of the --small runs), in the process layout of the service measured (its own process, or
for replicas in processes of their own a process built as a replica is: scale_out.py), on images preprocessed as
the engine does, their pixel values already on the model's device in its dtype (no host copy is the model's).
Per batch size of BATCHES (SMALL_BATCHES for --small): `runner.encode` synchronized per call, so each batch
runs as the runner's plan says (packed into graphs, or alone on an exact graph), two calls untimed, then the
median of at least MIN_CALLS; the reference is the batch with the most images/s
(`model_alone(...)["images_per_s"]`), and a report states that batch (`reference_text`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from benchmarks.common.device import sync
from benchmarks.common.stats import percentile

BATCHES = (1, 4, 8, 16, 32)  # images per runner.encode call
SMALL_BATCHES = (1, 4)  # the --small smoke runs (a CPU's seconds, not a measurement)
MIN_CALLS = 3  # timed calls per batch size, whatever the seconds


def engine_inputs(core, datas: Sequence[bytes]) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
    """Images (encoded bytes) preprocessed with the core's config and limits: pixel values [patches,
    patch_dim] on the model's device in its dtype, and their grids (t, h, w)."""
    from encoder_service.preprocessing import preprocess

    pre = [preprocess(d, core.preprocess_cfg, core.images.limits) for d in datas]
    loaded = core.loaded
    return [p.pixel_values.to(loaded.device, loaded.dtype) for p in pre], [tuple(p.grid_thw) for p in pre]


def median_ms(call: Callable[[], object], device: torch.device, *, seconds: float, max_calls: int) -> tuple[float, int]:
    """(median ms, timed calls) of `call` synchronized: two untimed, then at least MIN_CALLS, more while
    `seconds` last, at most `max_calls`."""
    def timed() -> float:
        t0 = time.perf_counter()
        call()
        sync(device)
        return (time.perf_counter() - t0) * 1e3

    for _ in range(2):
        timed()
    times, start = [], time.perf_counter()
    while len(times) < max_calls and (len(times) < MIN_CALLS or time.perf_counter() - start < seconds):
        times.append(timed())
    return percentile(times, 50), len(times)


def route_of(runner, grids) -> str:
    """How the runner runs these images: its graphs (bucket/kind) and eager batches, counted; "eager" for a
    runner without graphs."""
    if not hasattr(runner, "plan"):
        return "eager"
    counts = Counter("eager" if g is None else f"graph {g.bucket}/{g.kind}" for _, g in runner.plan(grids))
    return ", ".join(f"{route} x{n}" if n > 1 else route for route, n in counts.items())


def model_alone(runner, pixel_values: Sequence[torch.Tensor], grids: Sequence[tuple], device: torch.device, *,
                batches: Sequence[int] = BATCHES, seconds: float = 2.0, max_calls: int = 200) -> dict:
    """Per batch size (images cycled from `pixel_values`): ms per call, images/s, the runner's route; and the
    best batch: `batch`, `images_per_s`, `route`, `rows` (every batch size)."""
    rows = []
    for b in batches:
        pvs = [pixel_values[i % len(pixel_values)] for i in range(b)]
        bgrids = [grids[i % len(grids)] for i in range(b)]
        ms, calls = median_ms(lambda: runner.encode(pvs, bgrids), device, seconds=seconds, max_calls=max_calls)
        rows.append(dict(batch=b, patches=sum(p.shape[0] for p in pvs), route=route_of(runner, bgrids), ms=ms,
                         images_per_s=b / (ms / 1e3), calls=calls))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what the largest batch took back for the service
    best = max(rows, key=lambda r: r["images_per_s"])
    return dict(batch=best["batch"], images_per_s=best["images_per_s"], route=best["route"], rows=rows)


def reference_text(alone: dict) -> str:
    """How a report names the reference: '71.3 images/s at batch 16 (graph 16384/multi x4)'."""
    return f"{alone['images_per_s']:.1f} images/s at batch {alone['batch']} ({alone['route']})"
