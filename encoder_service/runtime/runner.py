"""Runs a loaded vision tower on batches of images: eagerly, or through captured CUDA graphs.

`make_runner(loaded, cuda_graphs=..., buckets=...)` is the one entry point the engine uses. Both runners
answer `encode(pixel_values, grid_thw) -> list[Tensor]`: one owned, contiguous output per image
(`[num_tokens_i, row_width]`, on the tower's device), in input order. Called from the single thread that
owns the GPU.

- `EagerRunner` (runtime/eager.py): one tower forward per batch; batches over `max_batch_patches` are split.
- `GraphRunner` (runtime/graphs.py): captured graphs per patch-token bucket; images are packed greedily
  into the smallest bucket that fits; batches above the largest bucket run eagerly.

The buckets: settings.py's DEFAULT_BUCKETS (the service's `--graph-buckets`) unless given, plus an exact
bucket for each of COMMON_RESOLUTIONS under the largest.

Attention: each runner holds an `AttentionPolicy` (ops/attention.py; `attention=` "auto" | "fa4" | "torch",
the service's `--attention`), runs its startup check at construction (CUDA, half precision: every layout
class the tower uses, the selected backend compiled and compared with float32; the graph runner also
inside a captured graph) and makes it active around every forward and capture (`use_policy`).
`describe()["attention"]` says which backend serves which layout class; it is logged at startup.
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

import torch

from encoder_service.ops.fast_path import triton
from encoder_service.runtime.eager import EagerRunner, GridTHW, module_device
from encoder_service.runtime.graphs import GraphRunner
from encoder_service.settings import DEFAULT_BUCKETS

log = logging.getLogger(__name__)

# Resolutions common enough that a single image of that size gets a bucket of exactly its patch count
# (no padding rows: at 1080p the ladder alone would pad Qwen2.5's 10764 patches to 16384).
COMMON_RESOLUTIONS = ((448, 448), (640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080), (2560, 1440))


def resolution_patches(width: int, height: int, spec) -> int:
    """Patch rows of one image of this size (sides rounded to the nearest multiple of patch * merge, as
    smart_resize does within its pixel bounds)."""
    factor = spec.patch_size * spec.merge_size
    h, w = (max(factor, round(x / factor) * factor) // spec.patch_size for x in (height, width))
    return h * w


def exact_resolution_buckets(spec, up_to: int) -> list[int]:
    return sorted({p for p in (resolution_patches(w, h, spec) for w, h in COMMON_RESOLUTIONS) if p <= up_to})


class TowerRunner(Protocol):
    buckets: list[int]

    def encode(self, pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[GridTHW]) -> list[torch.Tensor]: ...

    def describe(self) -> dict: ...


def make_runner(loaded, *, cuda_graphs: bool, buckets: Sequence[int] | None = None, attention: str = "auto",
                **kwargs) -> TowerRunner:
    """The runner for `loaded` (models/loader.py: LoadedModel).

    `buckets` (patch rows; None: settings.DEFAULT_BUCKETS) gain exact buckets (no padding, see graphs.py) for
    COMMON_RESOLUTIONS below the largest one. cuda_graphs=True on a CUDA device: a GraphRunner that captures
    graphs per bucket at construction (startup) and logs the buckets, the capture time and the memory the
    graphs hold. Otherwise (CPU, or `--no-cuda-graphs`): an EagerRunner. `attention`: the runner's attention
    choice (ops/attention.py: CHOICES); which backend serves which layout is logged.
    """
    device = torch.device(loaded.device) if loaded.device is not None else module_device(loaded.tower)
    if device.type == "cuda":
        log.info("fused kernels (ops/, CUDA half precision): %s", "on" if triton is not None else "off: no Triton")
    buckets = sorted({int(b) for b in buckets or DEFAULT_BUCKETS})
    # Exact graphs (no padding) for the common resolutions under the largest bucket.
    exact = exact_resolution_buckets(loaded.spec, max(buckets))
    if cuda_graphs and device.type == "cuda":
        return GraphRunner(loaded, buckets=buckets, capture=True, exact_buckets=exact, attention=attention, **kwargs)
    if cuda_graphs:
        log.info("cuda_graphs requested on %s: running eagerly (graphs need CUDA)", device)
    max_batch = kwargs.get("max_batch_patches")
    runner = EagerRunner(loaded, max_batch_patches=max_batch, attention=attention)
    if device.type == "cuda":
        log.info("%s", runner.attention.summary())
    return runner
