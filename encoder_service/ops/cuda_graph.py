"""One CUDA-graph capture, as every capture of the service runs it (runtime/graph_capture.py: the runner's
graphs; ops/backend_chain.py: a backend's check in a captured graph): `capturing(graph, pool)`.

  - thread_local mode: a CUDA call that another thread makes meanwhile (a server's pinned staging, a client's
    copy) does not invalidate the capture, as it would in the default global mode.
  - Python's cyclic garbage collector is paused from the capture's begin to its end (`gc_paused`: until the last
    capture open on any thread ends). A collection runs at whatever allocation of Python objects crosses its
    threshold, on the thread making it: inside a capture, on the capturing thread itself (which thread_local mode
    does not shield), where what it frees may make a CUDA call no capture allows. A torch.cuda.CUDAGraph in a
    reference cycle (each of a GraphRunner's graphs held its runner, so every dropped runner's graphs waited for a
    collection) was destroyed there: cudaGraphExecDestroy refused (torch only warns), the capture invalidated, and
    the next launch raised cudaErrorStreamCaptureInvalidated, "operation failed due to a previous error during
    capture". Seen inside quack's GEMM: its launch path makes many Python objects, so a collection often starts
    there and its launch is the first after it. torch.cuda.graph collected before each capture up to torch 2.8;
    since then only with torch.compiler.config.force_cudagraph_gc.
  - A capture that raised is undone before the error goes on: the thread's current stream restored (torch's
    exit restores it only after a capture_end that succeeded) and, when capture_end did not get through, the
    caching allocator no longer routing allocations into the pool (its entry would outlive the capture: every
    later free of memory used on two streams deferred for good, i.e. leaked). The pool is not captured into
    again: torch's pinned-memory allocator may still count the failed capture as recording into it, and has
    no call to end that.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

import torch


_paused = 0  # gc_paused blocks open, on every thread: the collector is process-wide
_was_enabled = False  # whether the first of them found it on
_paused_lock = threading.Lock()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic collection inside (explicit gc.collect() still runs); on again once the last block
    open on any thread ends (two captures on two threads: the first to end must not turn it on amid the
    other), if it was on before the first."""
    global _paused, _was_enabled
    with _paused_lock:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                gc.enable()


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """Capture into `graph` what runs inside (on torch.cuda.graph's capture stream), allocating from `pool`
    (None: a new pool of its own); see the module docstring. On failure the error is raised once the capture
    is undone; do not capture into `pool` again."""
    stream = torch.cuda.current_stream()
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    try:
        with gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    except BaseException:
        _undo(graph, pool, stream)
        raise


def _undo(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream) -> None:
    torch.cuda.set_stream(stream)
    try:
        graph.pool()  # answers only after a capture_end that got through (the allocator's part done)
    except RuntimeError:
        end_allocate_to_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_allocate_to_pool is not None:
            with contextlib.suppress(RuntimeError):  # not recording to it: capture_begin failed before that
                end_allocate_to_pool(stream.device.index, pool)
