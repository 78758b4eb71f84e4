"""Which implementation an op runs: its fast kernel on CUDA in half precision, its torch reference elsewhere.

The references keep the towers' eager op order (that of transformers), so CPU results are bit-identical run
to run, float32 stays within 1e-5 of transformers and bfloat16 on the CPU equals it bit for bit. The fast
kernels fuse and sometimes reorder steps (a bias folded into the residual that a GEMM epilogue adds): one
rounding to bfloat16 instead of two, which only pays, and only shows, in half precision. In float32 or
float64 on CUDA the references run too, so a CUDA float32 run checks the reference order on the device.
"""

from __future__ import annotations

import torch

try:  # Triton ships with the CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

HALF_PRECISION = (torch.bfloat16, torch.float16)


def fast_path(x: torch.Tensor) -> bool:
    """True where the fused kernels run: Triton present, x on CUDA in bfloat16 / float16."""
    return triton is not None and x.is_cuda and x.dtype in HALF_PRECISION
