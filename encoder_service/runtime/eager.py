"""The eager runner, and what both runners share (the input check, per-image rows out of a batch output, the
device-side metadata LRU). runtime/runner.py: the contract both runners answer, and which one runs.

`EagerRunner` runs the tower without graphs (CPU, `--no-cuda-graphs`, and the graph runner's route for
batches above its largest bucket): it concatenates the images, builds the batch metadata on the CPU
(per-shape LRU inside the tower), runs the tower once, splits the rows per image. Batches over
`max_batch_patches` are split.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from encoder_service.models.metadata import GridTHW
from encoder_service.ops.attention import ONE, SEVERAL, WINDOWS, AttentionPolicy, use_policy


def patches_of(grid: GridTHW) -> int:
    t, h, w = grid
    return int(t) * int(h) * int(w)


def tokens_of(grid: GridTHW, merge_size: int) -> int:
    return patches_of(grid) // (merge_size * merge_size)


def check_inputs(pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[GridTHW], patch_dim: int) -> None:
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
        self.device = torch.device(loaded.device) if loaded.device is not None else module_device(self.tower)
        self.dtype = loaded.dtype if loaded.dtype is not None else module_dtype(self.tower)
        self.buckets: list[int] = []
        self.max_batch_patches = max_batch_patches
        self._device_meta = DeviceMetadataCache(meta_cache_size)
        self.attention = attention if isinstance(attention, AttentionPolicy) else AttentionPolicy(attention)
        # An eager forward sees one image alone (ONE) and batches (SEVERAL); Qwen2.5 also its windows.
        self.check_attention((ONE, SEVERAL), capture=False)

    def check_attention(self, layouts: tuple[str, ...], *, capture: bool) -> None:
        """The attention policy's startup check (ops/attention.py: AttentionPolicy.check) for this tower's
        head dim, heads and dtype; a no-op off CUDA or in float32."""
        config = self.tower.config
        if getattr(config, "window_units", None):
            layouts = (*layouts, WINDOWS)
        self.attention.check(head_dim=config.head_dim, num_heads=config.num_heads, dtype=self.dtype,
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
        check_inputs(pixel_values, grid_thw, self.spec.patch_dim)
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


def module_device(m: torch.nn.Module) -> torch.device:
    for p in m.parameters():
        return p.device
    return torch.device("cpu")


def module_dtype(m: torch.nn.Module) -> torch.dtype:
    for p in m.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
