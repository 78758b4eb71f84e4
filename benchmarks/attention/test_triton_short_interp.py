"""Our Triton window kernel (ops/attention_triton.py: short_segment_attention) under the Triton interpreter,
on the CPU, against the float32 reference (ops/attention.py: reference_attention).

A developer's check beside the benchmarks, not a CI test: CI's CPU torch ships no Triton (~640 MB installed),
and the GPU tier (tests/gpu/test_ops_cuda.py) runs the same kernel compiled against the same reference. It needs
Triton importable AND TRITON_INTERPRET=1 from the start of the process (the kernels are decorated when ops/ is
first imported). A venv with CPU torch, triton 3.6 (the GPU machine's) and numpy < 2.3 (the interpreter's
reductions break on 2.4): `python3 -m venv /tmp/triton-venv && /tmp/triton-venv/bin/pip install torch==2.13.0
triton==3.6.0 'numpy<2.3' pytest`; then, from the repo root, without the tiers' conftests:

    TRITON_INTERPRET=1 /tmp/triton-venv/bin/python -m pytest --noconftest -q -p no:cacheprovider \
        benchmarks/attention/test_triton_short_interp.py

The rejected head-dim-split kernel's interpreter tests moved with it: benchmarks/attention/test_triton_split_interp.py.
"""

from __future__ import annotations

import pytest

# triton_interp skips this module without Triton or TRITON_INTERPRET=1
from benchmarks.attention.triton_interp import bf16_dot_in_the_interpreter, check, windows  # noqa: F401
from encoder_service.ops import attention_triton as T


@pytest.mark.parametrize("d", [72, 80])
def test_short_segment_windows_with_filler_slots(d):
    q, k, v, cu = windows(d)
    check(T.short_segment_attention(q, k, v, cu, 64), q, k, v, cu)
