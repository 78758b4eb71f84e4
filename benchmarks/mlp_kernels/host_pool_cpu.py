"""The completion thread's copy out of staging on this host's CPU, no GPU: torch's allocator (clone, the copy
before issue 23) against rowpath/host_pool.py's HostRowPool, as the service runs it: the copy on one thread
(the completion thread), the rows freed on another (the event loop's cache evicting), a cache at capacity (the
last WINDOW batches' rows kept). Per batch: the copy's wall ms, the process's CPU ms (the copy and the frees)
and minor page faults (medians after the window filled), two passes each (glibc adapts its mmap threshold to
blocks under 32 MiB on the way).

    .venv/bin/python -m benchmarks.mlp_kernels.host_pool_cpu [--threads 1]

Batches: Qwen3 4 x 720p (4 x 880 x 16384 bf16, 28.8 MB each) and Qwen3 1080p (2040 x 16384, 66.8 MB).
"""

from __future__ import annotations

import argparse
import collections
import queue
import resource
import statistics
import sys
import threading
import time

import torch

from encoder_service.rowpath.host_pool import HostRowPool

BATCHES = {"qwen3 4 x 720p": [(880, 16384)] * 4, "qwen3 1080p": [(2040, 16384)]}
WINDOW, ITERS = 8, 24


def run(copy, threads: int, window: int = WINDOW, iters: int = ITERS) -> tuple[float, float, float]:
    """(copy wall ms, process CPU ms, minor faults) per batch: medians after the window filled. CPU and faults
    from one batch's copy to the next: the copy, and the free of the batch the cache evicted meanwhile."""
    handed, res = queue.Queue(), []

    def completion():
        torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for i in range(iters):
            t0 = time.perf_counter()
            rows = copy()
            wall = (time.perf_counter() - t0) * 1e3
            handed.put(rows)
            del rows
            while handed.qsize():  # the evicting thread has taken it (and freed the oldest)
                time.sleep(0.0005)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if i >= window:
                res.append((wall, (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1e3,
                            r1.ru_minflt - r0.ru_minflt))
            r0 = r1
        handed.put(None)

    thread = threading.Thread(target=completion)
    thread.start()
    cache = collections.deque(maxlen=window)  # this thread evicts the oldest batch as each new one lands
    while (rows := handed.get()) is not None:
        cache.append(rows)
    thread.join()
    cache.clear()
    return tuple(statistics.median(r[k] for r in res) for k in range(3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {args.threads}; window {WINDOW} batches; medians of {ITERS - WINDOW}")
    print("| batch | rows into | pass | copy wall ms | process CPU ms | minor faults |\n|---|---|---|---|---|---|")
    for name, shapes in BATCHES.items():
        views = [torch.randn(*s).to(torch.bfloat16) for s in shapes]
        pool = HostRowPool()
        ways = {"torch's allocator (clone)": lambda: [v.clone() for v in views],
                "HostRowPool": lambda: [pool.take(v.numel() * 2).view(v.dtype).view(v.shape).copy_(v) for v in views]}
        for n in (1, 2):
            for way, copy in ways.items():
                wall, cpu, faults = run(copy, args.threads)
                print(f"| {name} | {way} | {n} | {wall:.1f} | {cpu:.1f} | {faults:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
