"""The REJECTED head-dim-split Triton kernel (benchmarks/attention/triton_split.py, out of the service: slower
than FlashAttention-4 and wrong on several layouts on the H100) under the Triton interpreter, on the CPU,
against the float32 reference. Kept with the kernel so that the candidates benchmark's measurement of it
stays reproducible; not part of the main suite (testpaths = tests). The interpreter passes these small
cases: the H100 failures (graph-padded and multi-segment layouts at real sizes, NaN rows, an illegal
address) did not show here.

Same requirements as benchmarks/attention/test_triton_short_interp.py (Triton 3.6, TRITON_INTERPRET=1):

    TRITON_INTERPRET=1 /tmp/triton-venv/bin/python -m pytest --noconftest -q -p no:cacheprovider \
        benchmarks/attention/test_triton_split_interp.py
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention import triton_split as T

# triton_interp skips this module without Triton or TRITON_INTERPRET=1
from benchmarks.attention.triton_interp import H, bf16_dot_in_the_interpreter, bounds, check, qkv, windows  # noqa: F401


@pytest.mark.parametrize("d", [72, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_mixed_segments(d, dtype):
    # zero-length (first, middle), 1 row, under a block, a block, over a block, a tail block
    lengths = [0, 1, 5, 0, 64, 17, 130, 1, 131]
    cu = bounds(lengths)
    q, k, v = qkv(int(cu[-1]), d, dtype, seed=d)
    check(T.split_head_attention(q, k, v, cu, max(lengths), config=T.SPLIT_CONFIGS["m64n64w4s2"]), q, k, v, cu)


@pytest.mark.parametrize("config", list(T.SPLIT_CONFIGS))
@pytest.mark.parametrize("d", [72, 80])
def test_split_every_config(config, d):
    cu = bounds([3, 200, 0, 129])
    q, k, v = qkv(int(cu[-1]), d, torch.float16, strided_v=d == 80, seed=1)
    check(T.split_head_attention(q, k, v, cu, 200, config=T.SPLIT_CONFIGS[config]), q, k, v, cu)


@pytest.mark.parametrize("d", [72, 80])
def test_split_graph_padded_layouts(d):
    """A real segment + the dummy segment up to the bucket + filler slots, max_seqlen = the bucket (a
    "single" graph has 2 slots, a "multi" graph max_images + 1)."""
    for lengths, slots in (([150, 106], 2), ([256, 0], 2), ([40, 60, 50, 106], 9)):  # 256 rows each
        cu = bounds(lengths, slots)
        q, k, v = qkv(256, d, torch.bfloat16, seed=2)
        check(T.split_head_attention(q, k, v, cu, 256), q, k, v, cu)  # the default config


@pytest.mark.parametrize("d", [64, 96, 128])
def test_split_other_head_dims(d):
    cu = bounds([40, 1, 70])
    q, k, v = qkv(111, d, torch.float16, seed=5)
    check(T.split_head_attention(q, k, v, cu, 70, config=T.SPLIT_CONFIGS["m64n64w4s2"]), q, k, v, cu)


def test_split_rows_past_the_last_boundary_are_not_written():
    q, k, v = qkv(60, 72, torch.float16, strided_v=False, seed=4)
    cu = bounds([7, 33])
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    T.split_head_attention(q, k, v, cu, 33, out=out)
    check(out[:40], q[:40], k[:40], v[:40], cu)
    assert out[40:].isnan().all()


def test_split_int64_boundaries_and_strided_q():
    g = torch.Generator().manual_seed(6)
    big = torch.randn(65, H, 2 * 72, generator=g).half()
    q, k = big[..., :72], big[..., 72:]  # unit last stride, row stride 2 * H * 72
    v = torch.randn(65, H, 72, generator=g).half()
    cu = bounds([20, 45]).long()
    check(T.split_head_attention(q, k, v, cu, 45, config=T.SPLIT_CONFIGS["m64n64w4s2"]), q, k, v, cu)


def test_split_no_rows_launches_nothing():
    q, k, v = qkv(8, 72, torch.float16)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    T.split_head_attention(q, k, v, bounds([0, 0, 0]), 0, out=out)
    assert out.isnan().all()


@pytest.mark.parametrize("d", [72, 80])
def test_split_windows_with_filler_slots(d):
    q, k, v, cu = windows(d)
    check(T.split_head_attention(q, k, v, cu, 64), q, k, v, cu)
