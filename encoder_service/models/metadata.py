"""Per-batch tower metadata, computed on the CPU from grid_thw alone (no device work, no sync).

Per-shape pieces (rotary cos/sin, Qwen2.5 window layout, Qwen3 position-embedding interpolation) are
computed once per (t, h, w) and kept in small LRUs; a batch concatenates them with offsets.

Row order inside the tower: pixel_values rows arrive in placeholder order, each merged token being
merge^2 consecutive patch rows (a "unit"), frames one after the other. Qwen2.5 runs its blocks in window
order (units permuted by `window_index`, a permutation within each frame) and permutes the merged
output back with `reverse_index`; everything row-aligned here (cos/sin) is already in that order.

Padding a batch to a CUDA graph's fixed shape has one rule, here: `PaddedShape.for_graph(bucket, kind, ...)`
gives the sizes a graph fixes, `BatchMetadata.padded(shape)` the padded batch (runtime/graphs.py only
copies it into the graph's buffers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

GridTHW = tuple[int, int, int]  # an image's (or frame group's) patch grid: frames, rows, columns (the one alias)

# Entries are small except cos/sin (a 1080p Qwen2.5 image: 10764 x 80 x 2 float32, about 7 MB).
_SHAPE_CACHE_SIZE = 64


@dataclass(frozen=True)
class BatchMetadata:
    """Everything the tower needs besides pixel_values, for one batch of images (optionally padded).

    `tensors()` are what a CUDA graph must hold as static buffers (copy new values in before each replay);
    `max_seqlen` / `max_window_seqlen` are Python ints that a graph fixes at capture, so they must be upper
    bounds for every batch replayed in it: `padded(shape)` gives a batch the graph's sizes. Rebuild around
    static buffers with `dataclasses.replace(meta, **buffers)`.
    """

    grid_thw: tuple[GridTHW, ...]
    merge_unit: int  # patches per merged token (merge_size ** 2)
    num_real_patches: int  # rows before padding
    cos: torch.Tensor  # [num_patches, head_dim] float32, in the tower's row order
    sin: torch.Tensor  # [num_patches, head_dim] float32
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32: one attention segment per frame
    max_seqlen: int
    # Qwen2.5 only. Units: merged tokens (merge_unit consecutive rows).
    window_index: torch.Tensor | None = None  # [num_units] int64: window-order unit i = input unit window_index[i]
    reverse_index: torch.Tensor | None = None  # [num_units] int64: argsort(window_index), back to placeholder order
    cu_window_seqlens: torch.Tensor | None = None  # [num_windows + 1] int32, in patches, window order
    max_window_seqlen: int | None = None
    # Qwen3 only: the learned position table resampled per patch (bilinear: 4 taps).
    pos_indices: torch.Tensor | None = None  # [num_patches, 4] int64 rows of the pos_embed table
    pos_weights: torch.Tensor | None = None  # [num_patches, 4] float32

    @property
    def num_patches(self) -> int:
        return self.cos.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def to(self, device: torch.device | str) -> BatchMetadata:
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def padded(self, shape: PaddedShape) -> BatchMetadata:
        """Metadata for the input padded with dummy rows up to `shape.num_patches` (see PaddedShape): the
        real rows' values are unchanged, so the tower's real output rows are too. Call it on the CPU
        metadata (before `.to(device)`): it reads boundaries on the host."""
        pad = shape.num_patches - self.num_patches
        if pad < 0 or pad % self.merge_unit:
            raise ValueError(
                f"cannot pad {self.num_patches} patches to {shape.num_patches}: needs a larger count that "
                f"differs by a multiple of {self.merge_unit}"
            )
        fields: dict = {
            "cos": F.pad(self.cos, (0, 0, 0, pad), value=1.0),  # identity rotation on dummy rows
            "sin": F.pad(self.sin, (0, 0, 0, pad), value=0.0),
            "cu_seqlens": pad_boundaries(self.cu_seqlens, shape.num_patches, shape.max_seqlen, shape.segment_slots),
            "max_seqlen": _checked_bound(shape.max_seqlen, self.max_seqlen, "max_seqlen"),
        }
        if self.window_index is not None:
            if shape.window_slots is None:
                raise ValueError("windowed metadata needs a shape with window_slots and max_window_seqlen")
            num_units, pad_units = self.num_patches // self.merge_unit, pad // self.merge_unit
            tail = torch.arange(num_units, num_units + pad_units, dtype=self.window_index.dtype)  # dummy units stay put
            fields |= {
                "window_index": torch.cat([self.window_index, tail]),
                "reverse_index": torch.cat([self.reverse_index, tail]),
                "cu_window_seqlens": pad_boundaries(
                    self.cu_window_seqlens, shape.num_patches, shape.max_window_seqlen, shape.window_slots, "window"
                ),
                "max_window_seqlen": _checked_bound(
                    shape.max_window_seqlen, self.max_window_seqlen, "max_window_seqlen"
                ),
            }
        if self.pos_indices is not None:
            fields |= {
                "pos_indices": F.pad(self.pos_indices, (0, 0, 0, pad)),
                "pos_weights": F.pad(self.pos_weights, (0, 0, 0, pad)),
            }
        return dataclasses.replace(self, **fields)


# ---- padding to a fixed shape (CUDA graphs) -----------------------------------------------------

# Graph kinds: what a batch padded to one of a runner's graphs holds (runtime/graphs.py captures one graph
# per patch-token bucket and kind).
EXACT = "exact"  # one one-frame image of exactly the bucket's patch count: no padding, one segment
SINGLE = "single"  # one one-frame image, then the dummy rows: two segments
MULTI = "multi"  # up to max_images frames (of any images), then the dummy rows


@dataclass(frozen=True)
class PaddedShape:
    """The fixed sizes of a padded batch: what a CUDA graph fixes at capture (tensor shapes, Python ints).

    The rows after the real ones are dummy attention segments of at most `max_seqlen` rows each (Qwen2.5
    also dummy windows of at most `max_window_seqlen` rows, each dummy unit kept in place by
    window_index), so they never attend to real rows and every kernel's max-seqlen bound holds; the
    boundary tensors then repeat num_patches (zero-length segments) up to their fixed length.
    """

    num_patches: int  # rows after padding (a multiple of merge_unit)
    segment_slots: int  # cu_seqlens has segment_slots + 1 boundaries
    max_seqlen: int  # bound on every segment, real or dummy
    window_slots: int | None = None  # Qwen2.5: cu_window_seqlens has window_slots + 1 boundaries
    max_window_seqlen: int | None = None

    @classmethod
    def for_graph(
        cls, bucket: int, kind: str, *, max_images: int, merge_unit: int, window_units: int | None = None
    ) -> PaddedShape:
        """The shape of graph `kind` for patch-token bucket `bucket`. `window_units`: Qwen2.5's window side
        in merged tokens (None for towers without windows)."""
        segment_slots = {EXACT: 1, SINGLE: 2, MULTI: max_images + 1}[kind]
        # max_seqlen = bucket: one dummy segment, and a real segment is never longer.
        if window_units is None:
            return cls(bucket, segment_slots, bucket)
        # A frame of u merged units (window side s units) has at most max(4 / s^2, 1 / s) * u + 1 windows
        # (edge windows are partial); dummy windows are chunks of a full window's rows.
        window_rows = window_units**2 * merge_unit
        per_unit = max(4 / window_units**2, 1 / window_units)
        real = int(per_unit * bucket // merge_unit) + max_images
        return cls(bucket, segment_slots, bucket, real + -(-bucket // window_rows) + 1, window_rows)


def pad_boundaries(real: torch.Tensor, num_patches: int, limit: int, slots: int, what: str = "segment") -> torch.Tensor:
    """[k + 1] real boundaries (ending at n_real) -> [slots + 1]: the rows n_real..num_patches as dummy
    segments of at most `limit` rows, then zero-length segments (repeats of num_patches)."""
    n_real = int(real[-1])
    dummy = list(range(n_real + limit, num_patches, limit)) + [num_patches] if num_patches > n_real else []
    out = torch.cat([real, real.new_tensor(dummy)])
    if out.numel() > slots + 1:
        raise ValueError(f"{what}_slots={slots} is too small: the padded batch has {out.numel() - 1} {what}s")
    return F.pad(out, (0, slots + 1 - out.numel()), value=num_patches)


def _checked_bound(bound: int, longest: int, what: str) -> int:
    if bound < longest:
        raise ValueError(f"{what}={bound} is below the longest segment of the batch ({longest})")
    return bound


# ---- per-shape pieces (CPU, cached) -------------------------------------------------------------


@lru_cache(maxsize=_SHAPE_CACHE_SIZE)
def block_order_positions(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) patch coordinates of one frame, in merge-block order: [h*w] int64 each."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    # (block_row, in_row, block_col, in_col) -> (block_row, block_col, in_row, in_col)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


@lru_cache(maxsize=_SHAPE_CACHE_SIZE)
def rotary_cos_sin(grid: GridTHW, merge: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2D rotary for one image, [t*h*w, head_dim] float32 each, placeholder order.

    As transformers: inv_freq over head_dim // 2 dims, angles row * inv_freq and col * inv_freq, laid
    out [row | col | row | col] (rotate_half pairs dim i with i + head_dim / 2)."""
    t, h, w = grid
    spatial_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
    rows, cols = block_order_positions(h, w, merge)
    positions = torch.stack([rows, cols], dim=1).repeat(t, 1)  # [t*h*w, 2]
    freqs = positions[..., None].float() * inv_freq  # [N, 2, head_dim / 4]
    halves = freqs.flatten(1)  # [N, head_dim / 2]: row angles then col angles
    angles = torch.cat([halves, halves], dim=-1)
    return angles.cos(), angles.sin()


@lru_cache(maxsize=_SHAPE_CACHE_SIZE)
def window_layout(grid: GridTHW, merge: int, window_units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5 windows of one image: (window_index [units] int64, window_sizes [windows] int64 in patches).

    The merged grid is cut into window_units x window_units windows from the top-left; edge windows are
    partial. transformers pads each side by `window_units - side % window_units` (a whole empty window row
    or column when the side is already divisible); empty windows are dropped, which is what we do.
    """
    t, h, w = grid
    gh, gw = h // merge, w // merge
    pad_h, pad_w = window_units - gh % window_units, window_units - gw % window_units
    nwh, nww = (gh + pad_h) // window_units, (gw + pad_w) // window_units
    index = torch.arange(t * gh * gw).view(t, gh, gw)
    index = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    index = index.view(t, nwh, window_units, nww, window_units).permute(0, 1, 3, 2, 4)
    index = index.reshape(t * nwh * nww, window_units * window_units)  # [windows, units per window]
    units_per_window = (index >= 0).sum(1)
    window_index = index[index >= 0]
    return window_index, units_per_window[units_per_window > 0] * merge * merge


@lru_cache(maxsize=_SHAPE_CACHE_SIZE)
def position_interpolation(grid: GridTHW, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: bilinear taps into the side x side learned table for one image, placeholder order.

    align_corners=True: patch row r of h maps to source row r * (side - 1) / (h - 1), computed and
    weighted in float32 as transformers 5.x does. Returns ([t*h*w, 4] int64, [t*h*w, 4] float32), taps
    ordered (top-left, top-right, bottom-left, bottom-right)."""
    t, h, w = grid
    rows, cols = block_order_positions(h, w, merge)
    row_taps, row_weights = _axis_taps(rows, h, side)
    col_taps, col_weights = _axis_taps(cols, w, side)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return indices.repeat(t, 1), weights.repeat(t, 1)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


# ---- batch assembly -----------------------------------------------------------------------------


def build_batch_metadata(
    grid_thw: list[GridTHW],
    *,
    merge: int,
    head_dim: int,
    rope_theta: float,
    window_units: int | None = None,
    pos_embed_side: int | None = None,
) -> BatchMetadata:
    """Concatenate the per-image pieces. `window_units` only for Qwen2.5, `pos_embed_side` only for Qwen3."""
    grids = tuple(tuple(int(x) for x in g) for g in grid_thw)
    if not grids:
        raise ValueError("empty batch: grid_thw has no images")
    for g in grids:
        if len(g) != 3 or min(g) < 1 or g[1] % merge or g[2] % merge:
            raise ValueError(f"grid_thw {g}: needs t, h, w >= 1 with h and w multiples of {merge}")
    rotary = [rotary_cos_sin(g, merge, head_dim, rope_theta) for g in grids]
    cos, sin = torch.cat([c for c, _ in rotary]), torch.cat([s for _, s in rotary])
    frame_lengths = [h * w for t, h, w in grids for _ in range(t)]
    fields: dict = {
        "cu_seqlens": _boundaries(frame_lengths),
        "max_seqlen": max(frame_lengths),
    }
    if window_units is not None:
        layouts = [window_layout(g, merge, window_units) for g in grids]
        unit_offsets = _boundaries([t * h * w // merge**2 for t, h, w in grids]).tolist()
        window_index = torch.cat([index + offset for (index, _), offset in zip(layouts, unit_offsets)])
        window_sizes = torch.cat([sizes for _, sizes in layouts])
        # cos/sin follow the rows into window order.
        cos, sin = gather_units(cos, window_index, merge * merge), gather_units(sin, window_index, merge * merge)
        fields |= {
            "window_index": window_index,
            "reverse_index": torch.argsort(window_index),
            "cu_window_seqlens": _boundaries(window_sizes.tolist()),
            "max_window_seqlen": int(window_sizes.max()),
        }
    if pos_embed_side is not None:
        interp = [position_interpolation(g, merge, pos_embed_side) for g in grids]
        fields |= {"pos_indices": torch.cat([i for i, _ in interp]), "pos_weights": torch.cat([w for _, w in interp])}
    return BatchMetadata(
        grid_thw=grids, merge_unit=merge * merge, num_real_patches=cos.shape[0], cos=cos, sin=sin, **fields
    )


def gather_units(rows: torch.Tensor, unit_index: torch.Tensor, merge_unit: int) -> torch.Tensor:
    """Reorder [N, C] rows by whole units of merge_unit consecutive rows: unit i of the result is unit
    unit_index[i] of the input."""
    return rows.view(-1, merge_unit, rows.shape[-1])[unit_index].flatten(0, 1)


def _boundaries(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 cumulative boundaries starting at 0."""
    return F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0)).to(torch.int32)
