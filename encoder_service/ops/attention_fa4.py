"""FlashAttention-4 (`flash-attn-4`, CuTe DSL) as an optional backend of the towers' attention op.

Optional: installed by the Dockerfile (pyproject extra `[fa4]`), imported only on a CUDA device of compute
capability 9.x / 10.x when a policy of ops/attention.py asks for it (never on the CPU, never at import of
this module). Any failure to import is recorded once and the policy falls back (ops/attention.py).
Checked against ops/attention_torch.py's float32 reference (`reference_attention`) by the policy's startup
check, tests/gpu/test_ops_cuda.py and benchmarks/attention/candidates.py.

`fa4_attention(q, k, v, cu_seqlens, max_seqlen)` keeps the op's contract: q, k, v [N, H, D] (v may be the
strided [:, 2] view of the fused qkv output: FA4 takes 16-byte aligned strides as they are, no copy),
cu_seqlens int32 [S + 1] (zero-length segments own no tile), max_seqlen a Python int bound.
From the library's sources (4.0.0b36, flash_attn/cute/interface.py):
  - sm90 forward: 8 <= D <= 256, D % 8 == 0 in bf16 / fp16 (sm100: D <= 128; ops/attention.py's BACKENDS
    entry takes 8..128, multiples of 8); the kernel tiles D to a multiple of 16 (72 in an 80-wide tile, 80
    exact) instead of 128. Output from torch.empty; no host sync; launches on torch's
    current stream (TVM-FFI env stream), so it captures into a CUDA graph.
  - JIT: `cute.compile` on the first call of each compile key (dtype, D, varlen, tile config, whether
    max_seqlen fits one M tile, > 256 segments ...: not N, not the segment count): ~3 s each, so every
    variant must be compiled before graph capture (the runners' warm-up and the policy's startup check do).
  - `cutlass` is put on sys.path by ops/cutlass_dsl.py when `pip install --target` skipped the DSL's .pth.
"""

from __future__ import annotations

import torch

from encoder_service.ops.cutlass_dsl import DslImport


def _load():
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


_FA4 = DslImport("flash_attn.cute", _load, majors=(9, 10), arch_note="FA4's forward is used on sm90 / sm100 only",
                 reason_chars=200)
# available(device) -> (usable, why not): imports flash_attn.cute on the first call for a CUDA device of sm90 /
# sm100.
available = _FA4.available


def fa4_attention(q, k, v, cu_seqlens, max_seqlen: int) -> torch.Tensor:
    fn = _FA4.require()
    out = fn(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
             max_seqlen_q=int(max_seqlen), max_seqlen_k=int(max_seqlen), causal=False)
    return out[0] if isinstance(out, (tuple, list)) else out  # (out, lse); lse is None without return_lse
