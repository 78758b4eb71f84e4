"""Trace and compile ops/quack_gemm.py's kernels (quack gemm_act: swiglu with the concatenated [gate; up]
weight and bias, per config of benchmarks/mlp_kernels/kernels.py's QUACK_CONFIGS; Qwen3's gelu_tanh_approx fc1 and
Qwen2's quick_gelu fc1 at quack's default tile, as ops/mlp_kernels.py calls them) for sm_90a WITHOUT a GPU,
and report what ptxas made of them: registers, spills, HGMMA (warpgroup MMA), TMA loads and stores in the
SASS. Nothing runs: the device queries quack makes before compiling are answered with the
H100's (capability 9.0, 132 SMs) and the launch is skipped; the CuTe DSL compiles on the CPU (CUTE_DSL_ARCH),
as quack's own async-compile workers do.

Needs torch, Triton and the wheels of scripts/gpu/stage_wheels.sh built for the local Python, installed
under a folder named site-packages (quack's epilogue fingerprint requires it: ops/quack_gemm.py):

    PYTHONPATH=/tmp/q/site-packages QUACK_CACHE_ENABLED=0 python -m benchmarks.mlp_kernels.compile_check_quack

Exit status 1 if a variant fails to trace or compile.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch

from benchmarks.mlp_kernels.kernels import QUACK_CONFIGS
from encoder_service.ops import quack_gemm as Q

SASS = r"\b(HGMMA|UTMALDG|UTMASTG|MUFU\.EX2|MUFU\.TANH|MUFU\.RCP)\b"


def stub_device() -> list:
    """Answer quack's device queries as an H100 would; record plans instead of launching them."""
    import quack.cute_dsl_utils as utils
    import quack.epilogue.frontend as frontend
    import quack.gemm_config as config
    import quack.gemm_interface as interface
    import quack.gemm_runtime.host as host

    for module in (utils, frontend, interface, config):
        if hasattr(module, "get_device_capacity"):
            module.get_device_capacity = lambda device=None: (9, 0)
    host.get_max_active_clusters = lambda cluster_size: 132 // cluster_size
    plans = []
    frontend.run_gemm_epi_plan = lambda plan, *args, **kwargs: plans.append(plan)
    return plans


def cubin_report(obj: Path) -> dict:
    """The device code embedded in a compiled .o of quack's cache: ptxas resource usage and SASS counts."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    data = obj.read_bytes()
    start = data.find(b"\x7fELF", 1)  # the cubin after the host object's own ELF header
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(data[start:])
        f.flush()
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    counts = collections.Counter(re.findall(SASS, sass))
    return dict(regs=int(regs.group(1)) if regs else None, local=int(local.group(1)) if local else None, **counts)


def main() -> int:
    loaded, why = Q.QUACK.get()
    if loaded is None:
        print(f"quack unusable here: {why}")
        return 1
    plans = stub_device()
    cache = Path(tempfile.mkdtemp(prefix="quack_cc_"))
    import quack.cache as quack_cache

    quack_cache.CACHE_DIR, quack_cache.CACHE_ENABLED = str(cache), True  # one fresh .o per variant, inspected
    x, w, b = torch.randn(1000, 1280).bfloat16(), torch.randn(6912, 1280).bfloat16(), torch.randn(6912).bfloat16()
    variants = [(f"swiglu concat {name}", lambda f=fields: Q.gemm_act_quack(x, w, b, "swiglu", fields=f))
                for name, fields in QUACK_CONFIGS.items()]
    w3, b3, x3 = torch.randn(4352, 1152).bfloat16(), torch.randn(4352).bfloat16(), torch.randn(1000, 1152).bfloat16()
    w2, b2 = torch.randn(5120, 1280).bfloat16(), torch.randn(5120).bfloat16()
    variants += [("gelu_tanh_approx default", lambda: Q.gemm_act_quack(x3, w3, b3, "gelu_tanh_approx")),
                 ("quick_gelu default", lambda: Q.gemm_act_quack(x, w2, b2, "quick_gelu"))]
    ok = True
    print("| variant | status | s | regs | spill (local) | HGMMA | TMA loads | TMA stores | EX2 | RCP |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, call in variants:
        before = set(cache.rglob("*.o"))
        t0 = time.perf_counter()
        try:
            call()
            new = sorted(set(cache.rglob("*.o")) - before)
            r = cubin_report(new[0]) if new else {}
            print(f"| {name} | ok | {time.perf_counter() - t0:.1f} | {r.get('regs')} | {r.get('local')} "
                  f"| {r.get('HGMMA', 0)} | {r.get('UTMALDG', 0)} | {r.get('UTMASTG', 0)} | {r.get('MUFU.EX2', 0)} "
                  f"| {r.get('MUFU.RCP', 0)} |")
        except Exception as e:  # noqa: BLE001 - report every variant
            ok = False
            print(f"| {name} | FAIL {type(e).__name__}: {str(e)[:300]} | | | | | | | | |")
    print(f"{len(plans)} launches skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
