"""A GraphRunner's captures (runtime/graphs.py), so that a capture that fails never ends a serving start.

`CudaCapture` captures one graph: a warm-up on its very shapes (the attention backends selected, Triton and
FA4 compiled, cuBLAS's algorithms picked: nothing compiles inside the capture), then ops/cuda_graph.py's
`capturing` in the pool the runner's graphs share. `capture_graph` tries once more after a capture that
raised, following `recover()`: a device sync, a collection of Python's garbage outside any capture (the graphs
of dropped runners are destroyed there, not inside the next capture) and a fresh pool (the failed capture's is
not captured into again). A graph that fails twice is left uncaptured: the runner runs its batches eagerly,
logs a WARNING and reports it (describe()["capture_failures"], on /metrics
`encoder_graph_capture_failures_total` and `encoder_graphs_eager`).

The runner takes any object with `capture(graph)` and `recover()` (`capturer=`): the CPU tests give it one that
fails on cue, so the retry and the eager route run without a GPU (tests/unit/test_graph_capture.py).
"""

from __future__ import annotations

import gc
import logging
from typing import Protocol

import torch

from encoder_service.ops.attention import use_policy
from encoder_service.ops.cuda_graph import capturing

log = logging.getLogger(__name__)

CAPTURE_ATTEMPTS = 2  # the first, and one more after recover()
WARMUP_RUNS = 2


class Capturer(Protocol):
    def capture(self, graph) -> None:
        """Capture `graph` (runtime/graphs.py: _Graph): its `graph` and `out` set, or an exception."""

    def recover(self) -> None:
        """What the next attempt needs after a capture raised."""


class CudaCapture:
    """Captures a runner's graphs, one memory pool for all (largest first: the smaller reuse its blocks)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()
    def capture(self, graph) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with use_policy(graph.attention):
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    graph.tower(graph.pixels, graph.meta)
            torch.cuda.current_stream().wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with capturing(cuda_graph, self.pool):
                out = graph.tower(graph.pixels, graph.meta)  # [bucket / merge^2, row_width], in the pool
        graph.graph, graph.out = cuda_graph, out

    def recover(self) -> None:
        torch.cuda.synchronize()  # what the failed attempt queued is done (a fault raises here, not later)
        gc.collect()
        self.pool = torch.cuda.graph_pool_handle()


def capture_graph(capturer: Capturer, graph) -> tuple[bool, list[str]]:
    """(captured, why each failed attempt failed): `graph` captured in at most CAPTURE_ATTEMPTS tries. Running
    out of device memory is not retried: it raises (too many buckets for the device is a setting to change)."""
    label = f"{graph.bucket}/{graph.kind}"
    errors: list[str] = []
    for attempt in range(1, CAPTURE_ATTEMPTS + 1):
        try:
            capturer.capture(graph)
            return True, errors
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any failed capture: tried again, then the graph's batches run eagerly
            errors.append(_reason(e))
            last = attempt == CAPTURE_ATTEMPTS
            log.warning("CUDA graph %s: capture failed (attempt %d of %d): %s%s", label, attempt, CAPTURE_ATTEMPTS,
                        errors[-1], ": its batches run eagerly" if last else ": trying again after a device sync")
            capturer.recover()
    return False, errors


def _reason(e: BaseException) -> str:
    """The error, and the one it was raised while handling (a failed capture_end hides the launch that failed)."""
    why = f"{type(e).__name__}: {str(e)[:300]}"
    cause = e.__cause__ or e.__context__
    return why if cause is None else f"{why} (while handling {type(cause).__name__}: {str(cause)[:300]})"
