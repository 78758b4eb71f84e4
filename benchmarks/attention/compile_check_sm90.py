"""Compile our Triton attention kernels for sm_90a WITHOUT a GPU (Triton's bundled ptxas) and report
what ptxas made of them: registers per thread, spills, shared memory, wgmma (Hopper warpgroup MMA) in the
PTX and HGMMA in the SASS. Nothing runs; it proves the kernels lower for the H100 before device time is
spent. Needs a Triton like the GPU machine's (3.6):

    /tmp/triton-venv/bin/python -m benchmarks.attention.compile_check_sm90     # from the repo root

Specialisations as the service launches them (16 heads, q/k/o contiguous, v the fused qkv's [:, 2] view,
bf16): the production short-segment kernel (ops/attention_triton.py) per head dim; the rejected split
kernel (benchmarks/attention/triton_split.py, kept for the candidates benchmark) per head dim (72, 80) x config x
segment slots (1, 2, 33, 272). Exit status 1 if any variant fails to compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.attention import triton_split as S
from encoder_service.ops import attention_triton as T

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
HEADS = 16


def _int_arg(value: int):
    """Triton's specialisation of an int argument: == 1 -> constexpr, % 16 == 0 -> divisibility 16."""
    if value == 1:
        return "constexpr", None
    return "i32", [["tt.divisibility", 16]] if value % 16 == 0 else None


def source(kernel, ints: dict, consts: dict, pointers=("Q", "K", "V", "O", "CU")) -> ASTSource:
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in pointers:
            signature[name] = "*i32" if name in ("CU", "cu_ptr") else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "num_segments":  # do_not_specialize
            signature[name] = "i32"
        elif name in ints:
            kind, attr = _int_arg(ints[name])
            signature[name] = kind
            if kind == "constexpr":
                constexprs[(i,)] = 1
            elif attr:
                attrs[(i,)] = attr
        elif name in ("qk_scale", "scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
    return ASTSource(kernel, signature, constexprs, attrs)


def usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True).stdout

    def num(key):
        m = re.search(rf"{key}:(\d+)", res)
        return int(m.group(1)) if m else None

    return {"regs": num("REG"), "local": num("LOCAL"), "hgmma": len(re.findall(r"\bHGMMA\b", sass))}


def split_variants():
    for d in (72, 80):
        row = HEADS * d
        ints = {"sqn": row, "sqh": d, "skn": row, "skh": d, "svn": 3 * row, "svh": d, "son": row, "soh": d}
        d0, d1 = S.split_head_dim(d)
        for cfg in S.SPLIT_CONFIGS.values():
            for slots in (1, 2, 33, 272):
                consts = dict(D=d, D0=d0, D1=max(d1, 16), HAS_TAIL=d1 > 0, TAIL_MASKED=d1 > 0 and d0 + d1 != d,
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SEG_P2=S.seg_p2(slots), ALIGN8=True)
                yield (f"split D{d} {cfg.name} slots {slots}", source(S._split_head_attn_kernel, ints, consts),
                       cfg.num_warps, cfg.num_stages)


def short_variants():
    for d in (72, 80):
        row = HEADS * d
        ints = {"s_qn": row, "s_qh": d, "s_kn": row, "s_kh": d, "s_vn": 3 * row, "s_vh": d, "s_on": row, "s_oh": d}
        consts = dict(D=d, BLOCK_M=64, BLOCK_D=128)
        yield (f"short D{d} m64", source(T._short_segment_attn_kernel, ints, consts,
                                         pointers=("q_ptr", "k_ptr", "v_ptr", "o_ptr", "cu_ptr")), 4, 3)


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    ok = True
    print(f"triton {triton.__version__}, target sm_90a")
    print("| kernel | status | regs | spill (local) | smem (B) | wgmma in PTX | HGMMA in SASS |")
    print("|---|---|---|---|---|---|---|")
    for name, src, warps, stages in [*split_variants(), *short_variants()]:
        try:
            k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
            u = usage(k.asm["cubin"])
            wgmma = len(re.findall(r"wgmma\.mma_async", k.asm["ptx"]))
            print(f"| {name} | ok | {u['regs']} | {u['local']} | {k.metadata.shared} | {wgmma} | {u['hgmma']} |")
        except Exception as e:  # noqa: BLE001 - report every variant
            ok = False
            print(f"| {name} | FAIL {type(e).__name__}: {str(e)[:300]} | | | | | |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
