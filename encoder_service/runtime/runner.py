"""Runs a loaded vision tower on batches of images: eagerly, or through captured CUDA graphs.

`make_runner(loaded, cuda_graphs=..., buckets=...)` is the one entry point the engine uses. Both runners
answer `encode(pixel_values, grid_thw) -> list[Tensor]`: one owned, contiguous output per image
(`[num_tokens_i, row_width]`, on the tower's device), in input order. Called from the single thread that
owns the GPU.

- `EagerRunner`: concatenates the images, builds the batch metadata on the CPU (per-shape LRU inside the
  tower), runs the tower once, splits the rows per image. Batches over `max_batch_patches` are split.
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
from collections import OrderedDict
from typing import Protocol, Sequence

import torch

from encoder_service.ops.attention import ONE, SEVERAL, WINDOWS, AttentionPolicy, use_policy
from encoder_service.ops.fast_path import triton
from encoder_service.settings import DEFAULT_BUCKETS

log = logging.getLogger(__name__)

GridTHW = tuple[int, int, int]

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


def patches_of(grid: GridTHW) -> int:
    t, h, w = grid
    return int(t) * int(h) * int(w)


def tokens_of(grid: GridTHW, merge_size: int) -> int:
    return patches_of(grid) // (merge_size * merge_size)


def _check_inputs(pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[GridTHW], patch_dim: int) -> None:
    if len(pixel_values) != len(grid_thw):
        raise ValueError(f"{len(pixel_values)} pixel_values but {len(grid_thw)} grid_thw")
    for i, (pv, g) in enumerate(zip(pixel_values, grid_thw)):
        if pv.dim() != 2 or pv.shape[0] != patches_of(g) or pv.shape[1] != patch_dim:
            raise ValueError(
                f"image {i}: pixel_values {tuple(pv.shape)} does not match grid_thw {tuple(g)} "
                f"(expected [{patches_of(g)}, {patch_dim}])"
            )


def split_rows(out: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """Per-image outputs, each its own contiguous tensor (never a view: a view into a batch output would
    pin the whole batch in a cache, and a view of a graph's static buffer would be overwritten)."""
    return [piece.clone() for piece in torch.split(out, list(counts), dim=0)]


class DeviceMetadataCache:
    """A small LRU of batch metadata already on the device, keyed by the batch's shape: a repeated batch
    shape costs a device-to-device copy per replay instead of building and uploading it again (cos/sin
    alone are 7 MB for a 1080p Qwen2.5 image). Used by the eager and the graph runner."""

    def __init__(self, size: int):
        self._entries: OrderedDict = OrderedDict()
        self._size = size

    def get(self, key, build):
        meta = self._entries.get(key)
        if meta is None:
            meta = build()  # may raise: nothing is cached then
            self._entries[key] = meta
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return meta


class EagerRunner:
    """Runs the tower eagerly: one forward per batch (per chunk of at most `max_batch_patches` patches)."""

    mode = "eager"

    def __init__(self, loaded, *, max_batch_patches: int | None = None, meta_cache_size: int = 64,
                 attention: str | AttentionPolicy = "auto"):
        self.loaded = loaded
        self.tower = loaded.tower
        self.spec = loaded.spec
        self.device = torch.device(loaded.device) if loaded.device is not None else _module_device(self.tower)
        self.dtype = loaded.dtype if loaded.dtype is not None else _module_dtype(self.tower)
        self.buckets: list[int] = []
        self.max_batch_patches = max_batch_patches
        self._device_meta = DeviceMetadataCache(meta_cache_size)
        self.attention = attention if isinstance(attention, AttentionPolicy) else AttentionPolicy(attention)
        # An eager forward sees one image alone (ONE) and batches (SEVERAL); Qwen2.5 also its windows.
        self.check_attention((ONE, SEVERAL), capture=False)

    def check_attention(self, layouts: tuple[str, ...], *, capture: bool) -> None:
        """The attention policy's startup check (ops/attention.py: AttentionPolicy.prepare) for this tower's
        head dim, heads and dtype; a no-op off CUDA or in float32."""
        config = self.tower.config
        if getattr(config, "window_units", None):
            layouts = (*layouts, WINDOWS)
        self.attention.prepare(head_dim=config.head_dim, num_heads=config.num_heads, dtype=self.dtype,
                               device=self.device, layouts=layouts, capture=capture)

    def device_metadata(self, grid_thw: list[GridTHW]):
        """tower.metadata(grid_thw) on the device, from the DeviceMetadataCache keyed by the batch's grids."""
        return self._device_meta.get(tuple(grid_thw), lambda: self.tower.metadata(list(grid_thw)).to(self.device))

    @torch.inference_mode()
    def forward_batch(self, pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[GridTHW]) -> torch.Tensor:
        """One tower call on the concatenation of the images: [sum tokens, row_width]."""
        grid_thw = [tuple(int(x) for x in g) for g in grid_thw]
        pv = torch.cat([p.to(self.device, non_blocking=True) for p in pixel_values], dim=0)
        pv = pv.to(self.dtype)
        with use_policy(self.attention):
            return self.tower(pv, self.device_metadata(grid_thw))

    @torch.inference_mode()
    def encode(self, pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[GridTHW]) -> list[torch.Tensor]:
        _check_inputs(pixel_values, grid_thw, self.spec.patch_dim)
        if not pixel_values:
            return []
        outputs: list[torch.Tensor] = []
        for chunk in _chunks_by_patches(list(grid_thw), self.max_batch_patches):
            out = self.forward_batch([pixel_values[i] for i in chunk], [grid_thw[i] for i in chunk])
            outputs.extend(split_rows(out, [tokens_of(grid_thw[i], self.spec.merge_size) for i in chunk]))
        return outputs

    def describe(self) -> dict:
        return {
            "runner": self.mode,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "buckets": [],
            "max_batch_patches": self.max_batch_patches,
            "attention": self.attention.describe(),
        }


def _chunks_by_patches(grids: list[GridTHW], max_patches: int | None) -> list[list[int]]:
    """Consecutive runs of image indices whose patch total stays within max_patches (an image larger than
    the limit gets a chunk of its own)."""
    if not max_patches:
        return [list(range(len(grids)))]
    chunks: list[list[int]] = [[]]
    total = 0
    for i, g in enumerate(grids):
        n = patches_of(g)
        if chunks[-1] and total + n > max_patches:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks


def _module_device(m: torch.nn.Module) -> torch.device:
    for p in m.parameters():
        return p.device
    return torch.device("cpu")


def _module_dtype(m: torch.nn.Module) -> torch.dtype:
    for p in m.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def make_runner(loaded, *, cuda_graphs: bool, buckets: Sequence[int] | None = None, attention: str = "auto",
                **kwargs) -> TowerRunner:
    """The runner for `loaded` (models/loader.py: LoadedModel).

    `buckets` (patch rows; None: settings.DEFAULT_BUCKETS) gain exact buckets (no padding, see graphs.py) for
    COMMON_RESOLUTIONS below the largest one. cuda_graphs=True on a CUDA device: a GraphRunner that captures
    graphs per bucket at construction (startup) and logs the buckets, the capture time and the memory the
    graphs hold. Otherwise (CPU, or `--no-cuda-graphs`): an EagerRunner. `attention`: the runner's attention
    choice (ops/attention.py: CHOICES); which backend serves which layout is logged.
    """
    device = torch.device(loaded.device) if loaded.device is not None else _module_device(loaded.tower)
    if device.type == "cuda":
        log.info("fused kernels (ops/, CUDA half precision): %s", "on" if triton is not None else "off: no Triton")
    buckets = sorted({int(b) for b in buckets or DEFAULT_BUCKETS})
    # Exact graphs (no padding) for the common resolutions under the largest bucket.
    exact = exact_resolution_buckets(loaded.spec, max(buckets))
    if cuda_graphs and device.type == "cuda":
        from encoder_service.runtime.graphs import GraphRunner

        return GraphRunner(loaded, buckets=buckets, capture=True, exact_buckets=exact, attention=attention, **kwargs)
    if cuda_graphs:
        log.info("cuda_graphs requested on %s: running eagerly (graphs need CUDA)", device)
    max_batch = kwargs.get("max_batch_patches")
    runner = EagerRunner(loaded, max_batch_patches=max_batch, attention=attention)
    if device.type == "cuda":
        log.info("%s", runner.attention.summary())
    return runner
