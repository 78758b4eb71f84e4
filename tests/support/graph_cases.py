"""Batches for the graph-runner tests (CPU static buffers in unit/, captured graphs in gpu/): grids with
equal patch totals but different image sizes (the stale-boundary case), and the check that each image of a
batch equals the tower run on that image alone, unpadded."""

from __future__ import annotations

import torch

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


def check_batch(runner, lm, grids, seed, atol=0.0, rtol=0.0):
    pvs = pixels(grids, lm.spec.patch_dim, seed)
    outs = runner.encode(pvs, grids)
    assert len(outs) == len(grids)
    for i, (out, pv, g) in enumerate(zip(outs, pvs, grids)):
        ref = alone(lm, pv, g)
        assert out.shape == ref.shape == (t_tokens(g), lm.spec.row_width)
        assert out.is_contiguous() and out.untyped_storage().nbytes() == out.numel() * out.element_size()
        if atol == 0 and rtol == 0:
            # Bit-equal, except where the CPU BLAS takes its matrix-vector path for a one-row GEMM (a
            # one-token image alone): there 1e-12 of the output scale (any boundary or padding error
            # shows at 1e-2 and above).
            diff = (out - ref).abs().max().item()
            assert diff <= 1e-12 * ref.abs().max().item(), f"image {i} {g} of {grids}: max diff {diff}"
        else:
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err <= rtol, f"image {i} {g} of {grids}: relative error {err}"
    return outs


def t_tokens(g):
    t, h, w = g
    return t * h * w // 4
