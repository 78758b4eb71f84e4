"""Where the service loses Qwen3's model throughput (issue 23: 66.3 images/s encode-only at concurrency 64
against 85.5 for the runner alone; Qwen2.5 63.8 against 66.6), measured on the pieces the service runs,
without HTTP, on Qwen3-VL-8B 720p (3520 patches, rows 880 x 16384 bf16 = 28.8 MB per image, 3.4x Qwen2.5's
8.6 MB) with the graphs the service replays for it (four images per batch: the 14400 multi graph).

  host_copy     the completion thread's work per batch (runtime/transfer.py): the pinned staging copy's host
                cost, the device-to-host copy's GPU time, the copy out of staging into new pageable tensors
                (torch's allocator: page faults on fresh memory; the same with one CPU thread), into reused
                (already touched) buffers, and into rowpath/host_pool.py's pool: fresh mappings, and mappings
                given back by a batch freed before (an LRU at capacity); for Qwen3 (4 x 28.8 MB) and Qwen2.5
                (3 x 8.6 MB), with the page faults each took
  runner_alone  runner.encode synchronized, batches of 1 to 4 routed as the service routes them: the
                reference images/s
  engine[...]   the engine itself (engine/engine.py: CPU pool, batcher, GPU thread, completion thread) in a
                closed loop of 64 callers over distinct 720p JPEGs, variant "<preprocess>,<threads>,<rows>,<kept>":
                  preprocess   torchvision (resize on the GPU on the pool threads' streams), pil (on the CPU),
                               predecoded (every job returns a ready device tensor: no preprocessing at all)
                  rows         pool: the engine's rows out of staging into its HostRowPool (the service now);
                               pool_thp: the same with transparent huge pages advised on its new mappings;
                               clone: into torch's allocator (before issue 23: HostRowPool(min_bytes=inf));
                               pinned: the pinned staging views handed out and dropped (no copy, nothing kept:
                               an upper bound, not a service, which must own its rows)
                  kept         all: every image's rows kept (load_bench's regime: its 24 GiB cache never fills,
                               all memory is fresh); window: the last WINDOW images' rows kept, older ones freed
                               (a cache at capacity evicting one entry per new one: the pool reuses their pages)
                per run: images/s after the warm-up, images per batch, the GPU thread's host ms per batch, the
                completion thread's wait ms per batch (copy wait + copy out), where the rows' memory came from
The engine is driven through its public submit(); the timing wrappers replace its encode stage and its private
HostCopier (a benchmark-only hook, not an API). The engine needs the service's wheels (encoder_service.
preprocessing imports PyAV): without them the engine items say so and the rest runs.
"""

from __future__ import annotations

import asyncio
import collections
import os
import resource
import statistics
import time
import types
from contextlib import contextmanager

import torch

ROWS_Q25 = (1196, 3584)  # Qwen2.5 720p: 4784 / 4 tokens x 3584
# The service's runner and engine settings that decide batches and routes (settings.py, make_runner): a batch of
# >= 8192 patches that its bucket pads by > 5% runs eagerly (three 720p images: 10560 in the 14400 graph); the
# batch budget is --batch-tokens 16384 capped at the largest bucket (16384): four 720p images per batch.
SERVICE_EAGER_MIN_PATCHES, SERVICE_BATCH_TOKENS, SERVICE_LARGEST_BUCKET = 8192, 16384, 16384
ENGINE_VARIANTS = ("torchvision,8,clone,all", "torchvision,8,pool,all", "torchvision,8,pool_thp,all",
                   "torchvision,8,clone,window",
                   "torchvision,8,pool,window", "predecoded,8,clone,window", "predecoded,8,pool,window",
                   "predecoded,8,pinned,window", "pil,8,pool,window")
CONCURRENCY, WARMUP, IMAGES, WINDOW = 64, 48, 256, 32
SERVICE_WHEELS = ("the service's wheels are missing here: carry .whl and `source scripts/gpu/env.sh` "
                  "(benchmarks/README.md)")


def missing_service_wheels() -> str:
    """'' if the engine's preprocessing imports, else what is missing and how to bring it."""
    try:
        import encoder_service.preprocessing  # noqa: F401 - PyAV (video) is imported there
    except ModuleNotFoundError as e:
        return f"No module named {e.name!r}: {SERVICE_WHEELS}"
    return ""


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def host_copy(outputs: list[torch.Tensor], iters: int = 8) -> dict:
    """Per batch (ms): HostCopier.start's host time (first call: the pinned staging allocation), the D2H copy's
    GPU time; then the copy out of staging: wait() into torch's allocator with the rows kept (fresh memory,
    as load_bench's 24 GiB cache keeps every entry) and in a steady state where the previous batch's rows are
    freed first (an LRU at capacity; glibc may hand the freed blocks back), the free itself, the same copy in
    one CPU thread, into buffers already touched, into the pool's fresh mappings (rows kept; with and without
    transparent huge pages advised) and into the pool after the previous batch was freed (its mappings
    reused); minor page faults per batch beside."""
    from encoder_service.rowpath.host_pool import HostRowPool
    from encoder_service.runtime.transfer import HostCopier

    nbytes = sum(o.numel() * o.element_size() for o in outputs)
    med = statistics.median

    def timed(fn) -> tuple[float, object]:
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out

    copier = HostCopier(HostRowPool(min_bytes=float("inf")))  # torch's allocator: the copy before the pool
    start_ms, fresh_ms, fresh_faults, keep = [], [], [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        ms, rows = timed(lambda: copier.start(outputs))
        start_ms.append(ms)
        torch.cuda.synchronize()  # the copy is done: wait() below is the copy out of staging alone
        f0 = _faults()
        ms, clones = timed(rows.wait)
        fresh_ms.append(ms)
        fresh_faults.append(_faults() - f0)
        keep.append(clones)
    del keep
    staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    views, off = [], 0
    for o in outputs:
        n = o.numel() * o.element_size()
        views.append(staging[off : off + n].view(o.dtype).view(o.shape))
        off += n
    d2h_ms = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for v, o in zip(views, outputs):
            v.copy_(o, non_blocking=True)
        e.record()
        e.synchronize()
        d2h_ms.append(s.elapsed_time(e))
    steady_ms, free_ms, previous = [], [], []
    for i in range(iters):
        if i:
            t0 = time.perf_counter()
            previous.clear()  # the previous batch's rows freed
            free_ms.append((time.perf_counter() - t0) * 1e3)
        ms, previous = timed(lambda: [v.clone() for v in views])
        steady_ms.append(ms)
    previous.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread_ms = [timed(lambda: [v.clone() for v in views])[0] for _ in range(iters)]
    finally:
        torch.set_num_threads(threads)
    reused = [v.clone() for v in views]  # touched once
    reused_ms = [timed(lambda: [r.copy_(v) for r, v in zip(reused, views)])[0] for _ in range(iters)]
    reused.clear()

    def into(pool):
        return [pool.take(v.numel() * v.element_size()).view(v.dtype).view(v.shape).copy_(v) for v in views]

    def fresh_pool(pool) -> tuple[list, list, list]:  # (ms, faults, rows kept) per batch
        out = ([], [], [])
        for _ in range(iters):
            f0 = _faults()
            ms, rows = timed(lambda: into(pool))
            out[0].append(ms)
            out[1].append(_faults() - f0)
            out[2].append(rows)
        return out

    thp_ms, thp_faults, kept = fresh_pool(HostRowPool(huge_pages=True))
    del kept
    pool = HostRowPool()
    pool_fresh_ms, pool_fresh_faults, kept = fresh_pool(pool)
    kept.clear()  # every mapping back in the pool (up to its idle bound)
    pool_reused_ms, pool_reused_faults, previous = [], [], []
    for _ in range(iters):
        previous.clear()
        f0 = _faults()
        ms, previous = timed(lambda: into(pool))
        pool_reused_ms.append(ms)
        pool_reused_faults.append(_faults() - f0)
    return dict(images=len(outputs), mb=round(nbytes / 1e6, 1), torch_threads=threads,
                start_ms=med(start_ms), start_first_ms=start_ms[0], d2h_gpu_ms=med(d2h_ms),
                d2h_gb_s=nbytes / med(d2h_ms) / 1e6, clone_ms=med(fresh_ms), clone_gb_s=nbytes / med(fresh_ms) / 1e6,
                clone_faults=med(fresh_faults), clone_steady_ms=med(steady_ms), free_ms=med(free_ms),
                clone_1thread_ms=med(one_thread_ms), copy_reused_ms=med(reused_ms),
                copy_reused_gb_s=nbytes / med(reused_ms) / 1e6, pool_fresh_ms=med(pool_fresh_ms),
                pool_fresh_faults=med(pool_fresh_faults), thp_fresh_ms=med(thp_ms), thp_fresh_faults=med(thp_faults),
                pool_reused_ms=med(pool_reused_ms),
                pool_reused_faults=med(pool_reused_faults), pool=pool.stats())


def host_copy_item(runner, pvs, grid) -> dict:
    """host_copy on the real outputs of a Qwen3 batch of four 720p images, and on Qwen2.5-sized ones."""
    with torch.inference_mode():
        q3 = runner.encode([pvs] * 4, [grid] * 4)
        torch.cuda.synchronize()
        rec = dict(qwen3_4x720p=host_copy(q3))
        q25 = [torch.randn(*ROWS_Q25, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        rec["qwen2_5_3x720p"] = host_copy(q25)
    return rec


@contextmanager
def service_routes(runner):
    """A graph runner routes batches as the service's does (the benchmark's captures with no eager rule)."""
    if not hasattr(runner, "eager_min_patches"):  # an eager runner: one route
        yield runner
        return
    saved = runner.eager_min_patches
    runner.eager_min_patches = SERVICE_EAGER_MIN_PATCHES
    try:
        yield runner
    finally:
        runner.eager_min_patches = saved


def runner_alone(runner, pvs, grid) -> dict:
    from benchmarks.bench_vit import time_call

    rec = {}
    with torch.inference_mode(), service_routes(runner):
        for k in (1, 2, 3, 4):
            ms, n = time_call(lambda k=k: runner.encode([pvs] * k, [grid] * k), runner.device, 5, 100, 1.5)
            rec[f"batch_{k}"] = dict(ms=ms, images_per_s=k / ms * 1e3, iters=n,
                                     graphs=[f"{b.bucket}/{g.kind if g else 'eager'}"
                                             for b, g in runner.plan([grid] * k)])
    return rec


class _TimedCopier:
    """HostCopier with the completion thread's wait() timed; rows "pinned" hands out the pinned views."""

    def __init__(self, rows: str, wait_ms: list):
        from encoder_service.rowpath.host_pool import HostRowPool
        from encoder_service.runtime.transfer import HostCopier

        pool = {"clone": HostRowPool(min_bytes=float("inf")), "pool_thp": HostRowPool(huge_pages=True)}.get(rows)
        self._copier, self._pinned, self._wait_ms = HostCopier(pool), rows == "pinned", wait_ms
        self.pool = self._copier.pool

    def start(self, outputs):
        rows = self._copier.start(outputs)
        pinned, wait_ms = self._pinned, self._wait_ms

        class Timed:
            def wait(self):
                t0 = time.perf_counter()
                if pinned:
                    out = rows.staged()
                else:
                    out = rows.wait()
                wait_ms.append((time.perf_counter() - t0) * 1e3)
                return out

        return Timed()


def engine_run(runner, variant: str, jpegs: list[bytes], loaded, *, concurrency: int = CONCURRENCY,
               warmup: int = WARMUP, window: int = WINDOW) -> dict:
    """A closed loop of `concurrency` callers through the engine, one image per submit; images/s over the
    completions after the first `warmup`."""
    from encoder_service import preprocessing
    from encoder_service.engine.engine import Engine, Job

    source, threads, rows_mode, kept_mode = variant.split(",")
    threads = int(threads)
    device, dtype = runner.device, runner.dtype
    cfg = preprocessing.PreprocessConfig.default_for(loaded.spec)
    limits = preprocessing.ImageLimits(max_image_bytes=64 << 20, max_pixels=100_000_000)
    header = preprocessing.probe(jpegs[0], limits)
    grid = tuple(int(x) for x in preprocessing.plan(header, cfg).grid_thw)
    if source == "predecoded":
        backend = preprocessing.make_backend("torchvision", cfg, limits, device)
        ready = backend.preprocess(jpegs[0], dtype).pixel_values

        def prepare(data, grid_thw):
            return ready
    else:
        backend = preprocessing.make_backend(source, cfg, limits, device)

        pin = device.type == "cuda"

        def prepare(data, grid_thw):  # core/images.py ImageReader.prepare: host pixels pinned for a CUDA model
            pv = backend.preprocess(data, dtype).pixel_values
            return pv.pin_memory() if pin and pv.device.type == "cpu" else pv

    reader = types.SimpleNamespace(prepare=prepare)  # the jobs' reader (engine/engine.py: Reader)
    batches, wait_ms = [], []

    def encode(pvs, grids):
        t0 = time.perf_counter()
        out = runner.encode(pvs, grids)
        batches.append((len(grids), (time.perf_counter() - t0) * 1e3))
        return out

    copier = _TimedCopier(rows_mode, wait_ms)
    kept = [] if kept_mode == "all" else collections.deque(maxlen=window)

    async def main():
        engine = Engine(encode=encode, batch_tokens=SERVICE_BATCH_TOKENS,
                        buckets=(SERVICE_LARGEST_BUCKET,), max_queue=256, cpu_threads=threads)
        engine._copier = copier
        await engine.start()
        done, todo = [], iter(range(len(jpegs)))

        async def caller():
            for i in todo:
                (item,) = engine.submit([Job(jpegs[i], grid, reader)])
                rows = (await item.future).rows
                if rows_mode != "pinned":
                    kept.append(rows)  # as the cache keeps them: all, or the last `window`
                done.append(time.perf_counter())

        try:
            await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(concurrency))), 120)
        finally:
            await engine.stop()
        return sorted(done)

    f0 = _faults()
    with torch.inference_mode(), service_routes(runner):
        done = asyncio.run(main())
    faults = _faults() - f0
    kept.clear()
    span = done[-1] - done[warmup]
    steady = batches[len(batches) // 4 :]  # past the ramp-up
    return dict(variant=variant, images=len(done), grid=grid, images_per_s=(len(done) - 1 - warmup) / span,
                mean_images_per_batch=statistics.mean(b[0] for b in steady),
                gpu_thread_host_ms_per_batch=statistics.median(b[1] for b in steady),
                completion_wait_ms_per_batch=statistics.median(wait_ms[len(wait_ms) // 4 :]),
                minor_faults_per_image=faults / len(done), pool=copier.pool.stats(), cpu_count=os.cpu_count())


def distinct_jpegs(count: int, base_index: int, size: tuple[int, int] = (1280, 720)) -> list[bytes]:
    """Distinct photo-like JPEGs (load_bench.py's: pixels and bytes differ per index)."""
    from benchmarks.common.images import make_jpegs

    return make_jpegs(size, range(base_index, base_index + count), seed=3)
