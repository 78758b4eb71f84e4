"""Our Triton attention kernels (ops/attention_triton.py) under the Triton interpreter, on the CPU, against
the float32 reference (ops/attention.py: reference_attention).

Skipped unless Triton is importable AND the process was started with TRITON_INTERPRET=1 (the kernels are
decorated when ops/ is first imported, so the variable must be set before that). The CI venv has neither:
CPU torch ships no Triton, and Triton (~640 MB installed) would be there only for these tests; the GPU tier
(tests/gpu/test_ops_cuda.py) runs the same kernels compiled. Run them with a venv that has torch (CPU),
triton 3.6 (the GPU machine's) and numpy < 2.3 (the interpreter's reductions break on 2.4), from the repo
root, without the other tiers' conftests (they need the service's dependencies):

    TRITON_INTERPRET=1 /work/kern/venv36/bin/python -m pytest --noconftest -q -p no:cacheprovider \
        tests/unit/test_attention_triton_interp.py

Small sizes only: the interpreter runs every program in numpy (about a minute in all).
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start of the process (see the docstring)", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from encoder_service.ops import attention_triton as T  # noqa: E402
from encoder_service.ops.attention import reference_attention  # noqa: E402

H = 2
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def bf16_dot_in_the_interpreter():
    """The interpreter (3.6 and 3.9) keeps bf16 as raw uint16 bits and its create_dot multiplies those bits
    as integers. Widen bf16 operands to float32 first (exact: what bf16 MMA with float32 accumulation
    computes); loads, stores and casts of bf16 are the interpreter's own."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(x):
        if x.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return x

    builder.create_dot = lambda self, a, b, *rest, **kw: original(self, widen(a), widen(b), *rest, **kw)
    yield
    builder.create_dot = original


def qkv(n, d, dtype, *, strided_v=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(n, 3, H, d, generator=g).to(dtype)
    q, k = fused[:, 0].contiguous(), fused[:, 1].contiguous()  # as the rotary writes them
    return q, k, (fused[:, 2] if strided_v else fused[:, 2].contiguous())  # v: the fused output's view


def bounds(lengths, slots=None):
    cu = [0]
    for x in lengths:
        cu.append(cu[-1] + x)
    if slots is not None:
        cu += [cu[-1]] * (slots + 1 - len(cu))  # zero-length filler slots repeat the last boundary
    return torch.tensor(cu, dtype=torch.int32)


def check(out, q, k, v, cu):
    ref = reference_attention(q, k, v, cu)
    assert not out.float().isnan().any(), "unwritten / NaN rows"
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[q.dtype], f"max abs err {err}"


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
        check(T.split_head_attention(q, k, v, cu, 256), q, k, v, cu)  # the service's config


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
def test_short_segment_windows_with_filler_slots(d):
    """Qwen2.5 windows in miniature (64, 48, 16, 12 rows), dummy 64-row windows, empty slots."""
    lengths = [64, 64, 48, 16, 64, 12, 48, 64, 16, 64, 64]
    cu = bounds(lengths, slots=16)
    q, k, v = qkv(int(cu[-1]), d, torch.bfloat16, seed=3)
    check(T.short_segment_attention(q, k, v, cu, 64), q, k, v, cu)
    check(T.split_head_attention(q, k, v, cu, 64), q, k, v, cu)  # the split kernel serves windows too
