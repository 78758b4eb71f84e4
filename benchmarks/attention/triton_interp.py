"""Helpers of the Triton interpreter tests (test_triton_short_interp.py: the production short-segment
kernel; test_triton_split_interp.py: the rejected split kernel). Importing it
skips the importing test module unless Triton is importable and TRITON_INTERPRET=1 was set at process start
(the kernels are compiled, not interpreted, otherwise); a module that imports `bf16_dot_in_the_interpreter`
gets it as an autouse fixture."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start of the process (see the test module's docstring)",
                allow_module_level=True)

import numpy as np
import torch
import triton.language as tl

from encoder_service.ops.attention import reference_attention

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


def windows(d: int):
    """Qwen2.5 windows in miniature (64, 48, 16, 12 rows), dummy 64-row windows, empty slots: q, k, v, cu."""
    cu = bounds([64, 64, 48, 16, 64, 12, 48, 64, 16, 64, 64], slots=16)
    return (*qkv(int(cu[-1]), d, torch.bfloat16, seed=3), cu)
