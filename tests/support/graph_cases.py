"""Batches for the graph-runner tests (CPU static buffers in unit/, captured graphs in gpu/): grids with
equal patch totals but different image sizes (the stale-boundary case), batches for every bucket the
service captures (with a tower narrow enough to run them all), and the check that each image of a batch
equals the tower run on that image alone, unpadded."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from encoder_service.models.configs import Qwen2_5VLConfig
from encoder_service.models.loader import LoadedModel
from encoder_service.models.metadata import EXACT, MULTI, SINGLE
from encoder_service.models.qwen2_5_vl import Qwen2_5VLTower
from encoder_service.runtime.eager import tokens_of
from encoder_service.runtime.runner import exact_resolution_buckets
from encoder_service.settings import DEFAULT_BUCKETS

BUCKETS = [64, 128, 256]

# Patch grids (t, h, w); merge 2, so h and w are even. Batches with equal totals but different sizes:
SAME_TOTAL_SINGLE = [[(1, 8, 8)], [(1, 4, 16)], [(1, 16, 4)], [(1, 2, 32)]]  # 64 each: bucket 64, single
SAME_TOTAL_MULTI = [  # 80 each: bucket 128, multi
    [(1, 8, 8), (1, 4, 4)],
    [(1, 4, 4), (1, 8, 8)],
    [(1, 4, 16), (1, 4, 4)],
    [(1, 10, 6), (1, 2, 10)],
    [(1, 2, 8), (1, 4, 4), (1, 6, 8)],
]
MIXED = [  # several buckets in one call, a video, and one image over the largest bucket (spills to eager)
    [(1, 8, 12), (2, 4, 4), (1, 10, 6), (1, 4, 4)],
    [(1, 16, 20), (1, 4, 4), (1, 12, 14), (1, 8, 8), (1, 6, 6)],
    [(1, 2, 2)] * 9 + [(1, 14, 14)],
]


def pixels(grids, patch_dim, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t * h * w, patch_dim, generator=g) for t, h, w in grids]


@torch.no_grad()
def alone(lm, pv, grid):
    """The tower on one image, unpadded, no runner."""
    x = pv.to(lm.device, lm.dtype)
    return lm.tower(x, lm.tower.metadata([grid]).to(lm.device))


def check_batch(runner, lm, grids, seed, rtol=0.0):
    """Each image's rows from `runner` against the tower run on that image alone: equal to 1e-12 of the
    output scale (rtol 0, for float64; see below), or within a relative L2 error of rtol."""
    pvs = pixels(grids, lm.spec.patch_dim, seed)
    outs = runner.encode(pvs, grids)
    assert len(outs) == len(grids)
    for i, (out, pv, g) in enumerate(zip(outs, pvs, grids)):
        ref = alone(lm, pv, g)
        assert out.shape == ref.shape == (tokens_of(g, lm.spec.merge_size), lm.spec.row_width)
        assert out.is_contiguous() and out.untyped_storage().nbytes() == out.numel() * out.element_size()
        if rtol == 0:
            # Not bit for bit: the batch's GEMMs have other row counts than the image's alone, and a BLAS
            # may round another shape differently (a matrix-vector path for a one-token image, another
            # kernel on another CPU); in float64 that is ~1e-15 of the output scale, while any boundary
            # or padding error shows at 1e-2 and above.
            diff = (out - ref).abs().max().item()
            assert diff <= 1e-12 * ref.abs().max().item(), f"image {i} {g} of {grids}: max diff {diff}"
        else:
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err <= rtol, f"image {i} {g} of {grids}: relative error {err}"
    return outs


# ---- every bucket the service captures ------------------------------------------------------------------

# A Qwen2.5 tower with the real patch (14), merge (2) and window (4 x 4 merged tokens), so the real exact
# buckets and window layout, but 1 head of 8 dims, one window block and one full-attention block, and one
# channel of one frame per patch: narrow enough to run a 16384-patch image in float64 on the CPU.
NARROW_QWEN2_5 = Qwen2_5VLConfig(
    model_type="qwen2_5_vl", depth=2, hidden_size=8, num_heads=1, hidden_act="silu", out_hidden_size=8,
    patch_size=14, temporal_patch_size=1, merge_size=2, in_channels=1, rope_theta=10000.0, intermediate_size=16,
    window_size=112, fullatt_block_indexes=(1,), mlp_pad_multiple=1,
)
# The service's graphs: settings' ladder plus the exact buckets of the common resolutions under its top.
SERVICE_BUCKETS = sorted(
    set(DEFAULT_BUCKETS) | set(exact_resolution_buckets(NARROW_QWEN2_5.spec(), max(DEFAULT_BUCKETS)))
)


def narrow_tower(device, dtype) -> LoadedModel:
    """NARROW_QWEN2_5 with random weights (std 0.2: attention far from uniform)."""
    tower = Qwen2_5VLTower(NARROW_QWEN2_5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in tower.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    tower = tower.to(device, dtype).eval().requires_grad_(False)
    return LoadedModel(tower, NARROW_QWEN2_5.spec(), Path("."), "narrow", torch.device(device), dtype)


def bucket_batches(bucket: int, exact_buckets) -> list[tuple[list, str]]:
    """[(grids, kind)] that land in `bucket`'s two graphs: one image (of exactly the bucket's patches for an
    exact bucket, else just above the next smaller bucket: the most padding), and several images filling
    it to halfway between the next smaller bucket and it."""
    below = max([b for b in SERVICE_BUCKETS if b < bucket], default=0)
    if bucket in exact_buckets:
        single = ([one_frame(bucket)], EXACT)
    else:
        single = ([one_frame(below + 4)], SINGLE)
    return [single, (_filling(bucket - (bucket - below) // 8 * 4), MULTI)]


def one_frame(patches: int) -> tuple[int, int, int]:
    """One frame of `patches` (a multiple of 4) patch rows, as square as even sides allow."""
    units = patches // 4
    side = max(d for d in range(1, math.isqrt(units) + 1) if units % d == 0)
    return (1, 2 * side, 2 * (units // side))


def _filling(total: int) -> list[tuple[int, int, int]]:
    """About 12 images summing to `total` patches (a multiple of 4): a two-frame video, sides whose merged
    length is odd (partial windows), and a last strip of one merged row taking what is left."""
    side = 2 * max(2, round(math.sqrt(total / 12) / 2))
    shapes = [(2, side, side), (1, side + 2, side - 2), (1, side + 6, side), (1, side, side + 10)]
    grids, left = [], total
    while (n := math.prod(shapes[len(grids) % len(shapes)])) < left:
        grids.append(shapes[len(grids) % len(shapes)])
        left -= n
    return grids + [(1, 2, left // 2)]
