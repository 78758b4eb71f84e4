"""Compile ops/swiglu_gemm_triton.py's kernel for sm_90a WITHOUT a GPU (Triton's bundled ptxas), every tile
config of its CONFIGS, and report what came out: registers per thread, spills, shared memory (the H100 allows
227 KB per block), wgmma in the PTX, TMA copies, HGMMA in the SASS. Nothing runs; it shows the kernel lowers
to TMA + warpgroup MMA for the H100 before device time is spent. Needs a Triton like the GPU machine's (3.6):

    /tmp/triton-venv/bin/python -m benchmarks.mlp_kernels.compile_check_swiglu     # from the repo root

Exit status 1 if a config fails to compile or needs more shared memory than the H100 has.
"""

from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.attention.compile_check_sm90 import usage
from encoder_service.ops import swiglu_gemm_triton as G

SMEM_LIMIT = 227 * 1024


def source(c: G.TileConfig) -> ASTSource:
    kernel = G._swiglu_gemm_kernel
    signature = {
        "x_desc": f"tensordesc<bf16[{c.block_m}, {c.block_k}]>",
        "w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>",
        "bias_ptr": "*bf16", "out_desc": f"tensordesc<bf16[{c.block_m}, {c.block_n}]>", "M": "i32", "I": "i32",
        "K": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
        "NUM_STAGES": "constexpr",
    }
    consts = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, NUM_STAGES=c.stages)
    index = {name: i for i, name in enumerate(kernel.arg_names)}
    # as the service launches it: I = 3456 and K = 1280 (Qwen2.5) are multiples of 16, the bias 16-byte aligned
    attrs = {(index[n],): [["tt.divisibility", 16]] for n in ("bias_ptr", "I", "K")}
    return ASTSource(kernel, signature, {(index[n],): v for n, v in consts.items()}, attrs)


def main() -> int:
    ok = True
    print(f"triton {triton.__version__}, target sm_90a")
    print("| config | status | regs | spill (local) | smem (B) | wgmma in PTX | TMA in PTX | HGMMA in SASS |")
    print("|---|---|---|---|---|---|---|---|")
    for c in G.CONFIGS:
        try:
            k = triton.compile(source(c), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": c.warps, "num_stages": c.stages})
            u, ptx = usage(k.asm["cubin"]), k.asm["ptx"]
            fits = k.metadata.shared <= SMEM_LIMIT
            ok &= fits
            print(f"| {c.name} | {'ok' if fits else 'SMEM OVER 227 KB'} | {u['regs']} | {u['local']} "
                  f"| {k.metadata.shared} | {len(re.findall(r'wgmma.mma_async', ptx))} "
                  f"| {len(re.findall(r'cp.async.bulk.tensor', ptx))} | {u['hgmma']} |")
        except Exception as e:  # noqa: BLE001 - report every config
            ok = False
            print(f"| {c.name} | FAIL {type(e).__name__}: {str(e)[:300]} | | | | | | |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
