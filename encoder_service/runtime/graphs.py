"""CUDA-graph runner: one captured tower forward per (patch-token bucket, graph kind), all in one pool.

A graph fixes at capture the padded shape of its batches (models/metadata.py: `PaddedShape.for_graph`:
bucket rows, segment and window slots, max seqlens) and holds static buffers: pixel_values [B, patch_dim]
and every tensor of the padded BatchMetadata (cos/sin, cu_seqlens, Qwen2.5 window_index / reverse_index /
cu_window_seqlens, Qwen3 pos_indices / pos_weights); the output [B / merge^2, row_width] (main rows and
Qwen3 deepstack rows) is the graph's own. A batch is padded by `BatchMetadata.padded(shape)` (the one
padding rule), then EVERY static buffer is rewritten before EVERY replay: keying graphs on token totals
while leaving segment boundaries stale gave silently wrong attention in SGLang (two batches with equal
totals but different image sizes). Outputs are cloned out of the static buffer before they are returned.

Graph kinds per bucket (two per bucket; models/metadata.py: EXACT, SINGLE, MULTI):
  - "exact" (buckets of common resolutions, `exact_buckets`): one one-frame image of exactly the bucket's
    patch count: no padding, one segment (attention layout class ONE).
  - "single" (other buckets): one image of one frame. Two segments (the image + the dummy), max_seqlen = B
    (PADDED_SINGLE).
  - "multi": up to `max_images` frames (+ dummy rows, then zero-length filler slots), max_seqlen = B
    (SEVERAL). Qwen2.5's window layers: WINDOWS in every kind.
Which attention backend runs each layout class is the runner's attention policy's (ops/attention.py); it
is selected at the warm-up before each capture (FA4 and Triton compile there, never inside a capture),
after the policy's startup check ran every layout class in a small captured graph. `describe()["attention"]`
and the startup log say which backend serves which layout class.

Captures (runtime/graph_capture.py): a failed one is tried once more; a graph that still cannot be captured
is left out of `graphs`, and the batches that would replay it run eagerly (`describe()["capture_failures"]`).

`capture=False` (whatever `capturer` is given) builds the same static buffers, pads, copies in, runs the tower
eagerly ON THE STATIC BUFFERS and copies out: every step but capture/replay, so CPU tests check the padding,
boundary and order logic exactly (tests/unit/test_graphs.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import torch

from encoder_service.models.metadata import EXACT, MULTI, SINGLE, BatchMetadata, PaddedShape
from encoder_service.ops.attention import ONE, PADDED_SINGLE, SEVERAL, use_policy
from encoder_service.runtime.graph_capture import Capturer, CudaCapture, capture_graph
from encoder_service.runtime.packing import PackedBatch, pack
from encoder_service.runtime.eager import (
    DeviceMetadataCache,
    EagerRunner,
    GridTHW,
    check_inputs,
    patches_of,
    split_rows,
    tokens_of,
)

log = logging.getLogger(__name__)

SOLO_REPLAYS = 3  # timed runs of each way per exact bucket at startup (GraphRunner._time_solo)


class _Graph:
    """One bucket and kind: its padded shape, static buffers and (once captured) the CUDA graph. It holds the
    tower and attention policy, not the runner: a runner dropped frees its graphs at once, never in a cyclic
    collection that might run inside another capture (ops/cuda_graph.py)."""

    def __init__(self, runner: GraphRunner, bucket: int, kind: str):
        self.tower, self.attention = runner.tower, runner.attention
        self.bucket, self.kind = bucket, kind
        self.shape = PaddedShape.for_graph(
            bucket, kind, max_images=runner.max_images, merge_unit=runner.merge_unit, window_units=runner.window_units
        )
        # Template batch: one small image, padded like any batch of this graph (an exact graph: one image
        # of exactly `bucket` patches, 1 x merge x bucket / merge).
        m = runner.spec.merge_size
        grid = (1, m, bucket // m) if kind == EXACT else (1, m * 2, m * 2)
        template = self.pad(self.tower.metadata([grid]))
        self.static = {name: t.to(runner.device).clone() for name, t in template.tensors().items()}
        self.meta = dataclasses.replace(template, **self.static)
        self.pixels = torch.zeros(bucket, runner.spec.patch_dim, device=runner.device, dtype=runner.dtype)
        self.pixels.normal_()  # warm-up / capture input: never zeros (they hide indexing errors)
        self.graph = None  # set by runtime/graph_capture.py
        self.out = None

    def pad(self, meta: BatchMetadata) -> BatchMetadata:
        """A batch's CPU metadata padded to this graph's shape; ValueError if it does not fit."""
        return meta.padded(self.shape)

    @torch.inference_mode()
    def run(self, pixel_values: Sequence[torch.Tensor], padded_meta) -> torch.Tensor:
        """Copy the batch in (every static buffer), replay, return the graph's output buffer (a view the
        next replay overwrites: the caller clones what it keeps)."""
        for name, value in padded_meta.tensors().items():
            self.static[name].copy_(value, non_blocking=True)
        for key in ("max_seqlen", "max_window_seqlen", "merge_unit"):
            if getattr(padded_meta, key) != getattr(self.meta, key):
                raise RuntimeError(f"{key}: batch has {getattr(padded_meta, key)}, graph {getattr(self.meta, key)}")
        offset = 0
        for pv in pixel_values:
            self.pixels[offset : offset + pv.shape[0]].copy_(pv, non_blocking=True)
            offset += pv.shape[0]
        self.pixels[offset:].zero_()
        if self.graph is not None:
            self.graph.replay()
            return self.out
        with use_policy(self.attention):
            return self.tower(self.pixels, self.meta)


class GraphRunner:
    """TowerRunner replaying captured graphs; see the module docstring."""

    def __init__(
        self,
        loaded,
        *,
        buckets: Sequence[int],
        capture: bool = True,
        max_images: int = 32,
        meta_cache_size: int = 64,
        max_batch_patches: int | None = None,
        eager_min_patches: int | None = 8192,
        max_padding: float = 0.05,
        exact_buckets: Sequence[int] = (),
        solo_min_patches: int | None = 4096,
        measure_solo: bool = False,
        attention: str = "auto",
        capturer: Capturer | None = None,
    ):
        # spill / policy path; its attention policy is this runner's too
        self.eager = EagerRunner(loaded, max_batch_patches=max_batch_patches, attention=attention)
        self.attention = self.eager.attention
        self.tower, self.spec = loaded.tower, loaded.spec
        self.device, self.dtype = self.eager.device, self.eager.dtype
        self.merge_unit = self.spec.merge_size**2
        self.window_units = getattr(self.tower.config, "window_units", None)  # Qwen2.5 only
        self.max_images = max_images
        # A batch this large keeps the GPU busy through eager launches, so a graph buys nothing there and
        # its padding costs: such a batch runs eagerly when its bucket would pad more than max_padding.
        self.eager_min_patches, self.max_padding = eager_min_patches, max_padding
        # An image with an exact graph of its own may run alone on that graph, whatever it was batched with:
        # a large one fills the GPU, so packing buys nothing (the multi graph's varlen attention and padding
        # can even cost more), while 8 x 448^2 in one graph beat 8 replays. Captured runners measure which
        # (`solo_buckets`, below); uncaptured ones take the exact buckets of at least solo_min_patches.
        self.buckets = sorted({-(-int(b) // self.merge_unit) * self.merge_unit for b in buckets} | set(exact_buckets))
        self.exact_buckets = frozenset(int(b) for b in exact_buckets)
        if any(b % self.merge_unit for b in self.exact_buckets):
            raise ValueError(f"exact buckets must be multiples of {self.merge_unit}: {sorted(self.exact_buckets)}")
        self._device_meta = DeviceMetadataCache(meta_cache_size)

        cuda = capture and self.device.type == "cuda"
        capturer = capturer if capture else None  # capture=False: static buffers, whatever capturer is given
        if cuda:  # every layout class a graph may hold, checked inside a small captured graph first
            self.eager.check_attention((ONE, PADDED_SINGLE, SEVERAL), capture=True)
            capturer = capturer or CudaCapture()
            torch.cuda.synchronize()
            reserved0 = torch.cuda.memory_reserved()
        self.mode = "cuda_graphs" if capturer is not None else "static_buffers"
        start = time.perf_counter()
        self.graphs: dict[tuple[int, str], _Graph] = {}  # without the graphs that could not be captured
        self.capture_failures: list[dict] = []  # per graph whose capture failed: bucket, kind, errors, eager
        self.capture_log: list[tuple[int, str, int]] = []  # (bucket, kind, MiB reserved after its capture)
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its pool blocks
            for kind in (EXACT if bucket in self.exact_buckets else SINGLE, MULTI):
                graph = _Graph(self, bucket, kind)
                if capturer is not None:
                    captured, errors = capture_graph(capturer, graph)
                    if errors:
                        self.capture_failures.append(dict(bucket=bucket, kind=kind, errors=errors, eager=not captured))
                    if not captured:
                        continue  # plan() finds no graph for its batches: they run eagerly
                if cuda:
                    self.capture_log.append((bucket, kind, torch.cuda.memory_reserved() // 2**20))
                self.graphs[(bucket, kind)] = graph
        self.capture_s = time.perf_counter() - start
        self.graph_bytes = 0
        if cuda:
            torch.cuda.synchronize()
            self.graph_bytes = torch.cuda.memory_reserved() - reserved0
        self.solo_timings = self._time_solo() if cuda or measure_solo else {}
        # Only a bucket whose exact graph exists: without it an image alone runs eagerly, where packed with
        # others it replays a multi graph.
        self.solo_buckets = frozenset(
            b for b in self.exact_buckets if (b, EXACT) in self.graphs
            and (self.solo_timings[b]["solo"] if b in self.solo_timings
                else solo_min_patches is not None and b >= solo_min_patches))
        eager = ", ".join(f"{f['bucket']}/{f['kind']}" for f in self.capture_failures if f["eager"])
        log.log(
            logging.WARNING if eager else logging.INFO,
            "%s: %d graphs, buckets %s (patch rows; exact %s), max %d images per graph, captured in %.2f s, "
            "%.1f MiB held%s", self.mode, len(self.graphs), self.buckets, sorted(self.exact_buckets), max_images,
            self.capture_s, self.graph_bytes / 2**20, f"; not captured, run eagerly: {eager}" if eager else "",
        )
        if cuda:
            log.info("%s", self.attention.summary())

    @torch.inference_mode()
    def encode(self, pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[GridTHW]) -> list[torch.Tensor]:
        check_inputs(pixel_values, grid_thw, self.spec.patch_dim)
        grids = [tuple(int(x) for x in g) for g in grid_thw]
        outputs: list[torch.Tensor | None] = [None] * len(grids)
        for batch, graph in self.plan(grids):
            pvs = [pixel_values[i] for i in batch.indices]
            bgrids = [grids[i] for i in batch.indices]
            counts = [tokens_of(g, self.spec.merge_size) for g in bgrids]
            out = None
            if graph is not None:
                padded = self._padded_meta(graph, bgrids)
                if padded is not None:
                    out = graph.run(pvs, padded)[: sum(counts)]
            if out is None:  # over the largest bucket (or the slots, or policy): eagerly, unpadded
                out = self.eager.forward_batch(pvs, bgrids)
            for i, piece in zip(batch.indices, split_rows(out, counts)):
                outputs[i] = piece
        return outputs

    def plan(self, grids: list[GridTHW]) -> list[tuple]:
        """[(PackedBatch, _Graph or None for eager)] for a batch of images, in order of first input index:
        solo images (`solo_buckets`) on their exact graphs, the rest packed (runtime/packing.py)."""
        solo = {i for i, g in enumerate(grids) if self._solo(g)}
        rest = [i for i in range(len(grids)) if i not in solo]
        plan = [PackedBatch((i,), patches_of(grids[i]), 1, patches_of(grids[i])) for i in sorted(solo)]
        packed = pack([patches_of(grids[i]) for i in rest], self.buckets, segments=[grids[i][0] for i in rest],
                      max_segments=self.max_images)
        plan += [dataclasses.replace(b, indices=tuple(rest[j] for j in b.indices)) for b in packed]
        plan.sort(key=lambda b: b.indices[0])
        routes = []
        for batch in plan:
            graph = None
            if batch.bucket is not None and not self._prefer_eager(batch):
                kind = MULTI
                if len(batch.indices) == 1 and grids[batch.indices[0]][0] == 1:
                    if batch.bucket not in self.exact_buckets:
                        kind = SINGLE
                    elif batch.patches == batch.bucket:
                        kind = EXACT
                graph = self.graphs.get((batch.bucket, kind))  # None: its capture failed (eager)
            routes.append((batch, graph))
        return routes

    def _solo(self, grid: GridTHW) -> bool:
        return grid[0] == 1 and patches_of(grid) in self.solo_buckets

    @torch.inference_mode()
    def _time_solo(self) -> dict[int, dict]:
        """Per exact bucket b: k images of b patches (as many as the largest bucket and max_images allow, k >=
        2) one replay each on the exact graph, against them packed as plan() would run them (one replay of a
        multi graph, or eagerly: `_prefer_eager`); wall ms, synchronized, median of SOLO_REPLAYS after one
        untimed; and whether alone is no slower ("solo"). Captured runners pay it once, at startup (four runs
        of each way per exact bucket, next to the captures); the CPU tests run it on the static buffers
        (measure_solo)."""
        timings = {}
        m, largest = self.spec.merge_size, max(self.buckets)
        for b in sorted(self.exact_buckets):
            k = min(self.max_images, largest // b)
            if k < 2:
                continue
            grid = (1, m, b // m)
            packed_bucket = next(x for x in self.buckets if x >= k * b)
            alone = self.graphs.get((b, EXACT))
            packed = self.graphs.get((packed_bucket, MULTI))
            if alone is None or packed is None:  # a capture that failed: nothing to time
                continue
            pixels = [alone.pixels[:b]]
            alone_meta = self._padded_meta(alone, [grid])
            packed_meta = self._padded_meta(packed, [grid] * k)
            if alone_meta is None or packed_meta is None:
                continue
            alone_ms = _median_ms(lambda: alone.run(pixels, alone_meta), self.device)
            if self._prefer_eager(PackedBatch(tuple(range(k)), k * b, k, packed_bucket)):  # as plan() would
                route, run = "eager", lambda: self.eager.forward_batch(pixels * k, [grid] * k)
            else:
                route, run = MULTI, lambda: packed.run(pixels * k, packed_meta)
            packed_ms = _median_ms(run, self.device)
            timings[b] = dict(images=k, alone_ms=round(alone_ms, 3), packed_bucket=packed_bucket,
                              packed_route=route, packed_ms=round(packed_ms, 3), solo=k * alone_ms <= packed_ms)
        if timings:
            log.info("exact buckets run alone (k replays no slower than k images packed): %s", ", ".join(
                f"{b}: {t['images']} x {t['alone_ms']:.2f} vs {t['packed_ms']:.2f} ms -> "
                f"{'alone' if t['solo'] else 'packed'}" for b, t in timings.items()))
        return timings

    def _prefer_eager(self, batch) -> bool:
        return (
            self.eager_min_patches is not None
            and batch.patches >= self.eager_min_patches
            and batch.padding > self.max_padding * batch.bucket
        )

    def _padded_meta(self, graph: _Graph, grids: list[GridTHW]):
        """Padded metadata of this batch for this graph, on the device, from the DeviceMetadataCache keyed by
        (bucket, kind, grids). None if the batch does not fit the graph's slots."""
        key = (graph.bucket, graph.kind, tuple(grids))
        try:
            return self._device_meta.get(key, lambda: graph.pad(self.tower.metadata(grids)).to(self.device))
        except ValueError as e:
            log.warning("batch %s does not fit graph %s/%s (%s): running eagerly", grids, graph.bucket, graph.kind, e)
            return None

    def describe(self) -> dict:
        return {
            "runner": self.mode,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "buckets": self.buckets,
            "exact_buckets": sorted(self.exact_buckets),
            "graphs": len(self.graphs),
            "capture_failures": self.capture_failures,
            "max_images": self.max_images,
            "eager_min_patches": self.eager_min_patches,
            "max_padding": self.max_padding,
            "solo_buckets": sorted(self.solo_buckets),
            "solo_timings": self.solo_timings,
            "capture_s": round(self.capture_s, 3),
            "graph_mib": round(self.graph_bytes / 2**20, 1),
            "attention": self.attention.describe(),
        }


def _median_ms(run, device: torch.device) -> float:
    """Median wall ms of SOLO_REPLAYS calls of `run`, synchronized, after one untimed."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    times = []
    for _ in range(SOLO_REPLAYS):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]
