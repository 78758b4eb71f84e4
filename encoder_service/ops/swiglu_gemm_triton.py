"""Qwen2.5's gate/up GEMM with the SwiGLU in its epilogue, in Triton: one kernel instead of cuBLAS + silu_mul.

`swiglu_gemm_triton(x, weight, bias)`: x [N, E], weight [2 * I, E] (gate rows first, as models/layers.py's
`gate_up_proj` stores them), bias [2 * I] -> silu(x @ Wg^T + bg) * (x @ Wu^T + bu) [N, I].

Each program owns an output tile [BLOCK_M, BLOCK_N] of the hidden and keeps two float32 accumulators: the
gate tile (weight rows off_n..) and the up tile (rows I + off_n..), fed by the same x tile, so the wide
[N, 2 * I] product is never written (at Qwen2.5 1080p that is 149 MB written and read back per layer).
Bias, SiLU and the product run in float32 on the accumulators; one rounding to the model dtype at the store
(the split path rounds the GEMM output, then the SiLU, then the product).

Operands move by TMA (host-side tensor descriptors: 16-byte aligned rows, so E and I multiples of 8 in
half precision, which `serves` checks). A gate tile that runs past I reads up rows into columns the store
clips; an up tile past 2 * I reads TMA's zero fill. No host sync, no allocation but the output: capturable.
benchmarks/mlp_kernels/compile_check_swiglu.py compiles every config for sm_90a without a GPU (TMA + wgmma, no spills).
Tile configs: CONFIGS (the benchmark, benchmarks/mlp_kernels/, times them on the H100; DEFAULT_CONFIG
is the one the service runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encoder_service.ops.fast_path import tl, triton

try:  # Triton >= 3.3 (host-side TMA descriptors)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 128
    block_n: int = 128  # hidden columns per tile: the GEMM tile is 2 * block_n wide (gate + up)
    block_k: int = 64
    group_m: int = 8  # tiles of one column band walked together (L2 reuse of the weight)
    stages: int = 3
    warps: int = 8
    persistent: bool = False  # one program per SM looping over tiles, else one program per tile

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.stages}w{self.warps}"
                + ("p" if self.persistent else ""))


# The fastest of the sweep on the H100 (benchmarks/mlp_kernels/; benchmarks/RESULTS.md, "Speed (issue 23)"),
# persistent ahead of the same tile launched per tile.
DEFAULT_CONFIG = TileConfig(persistent=True)
# What the benchmark sweeps (shared memory per stage: (block_m + 2 * block_n) * block_k * 2 bytes, plus the
# output tile; the H100 has 227 KB per block).
CONFIGS = (
    DEFAULT_CONFIG,
    TileConfig(),
    TileConfig(stages=4),
    TileConfig(stages=4, persistent=True),
    TileConfig(block_m=128, block_n=64, stages=4, warps=4),
    TileConfig(block_m=64, block_n=128, stages=4, warps=4),
    TileConfig(block_m=256, block_n=64, stages=3, warps=8),
    TileConfig(block_k=128, stages=2),
)


def serves(device: torch.device, e: int, i: int) -> str:
    """'' if this kernel runs on `device` for widths E and I (bfloat16 / float16 operands), else why not."""
    if triton is None or TensorDescriptor is None:
        return "needs Triton with host-side tensor descriptors (>= 3.3)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return "needs TMA (CUDA sm90+)"
    if e % 8 or i % 8:
        return f"E={e} and I={i} must be multiples of 8 (16-byte rows for TMA)"
    return ""


def swiglu_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *,
                       config: TileConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, E] x [2 * I, E] (+ bias [2 * I]) -> silu(gate) * up [N, I]; `config` None: DEFAULT_CONFIG (read at
    the call); `out` [N, I] if given (else new)."""
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    n, e = x.shape
    i = weight.shape[0] // 2
    if out is None:
        out = torch.empty(n, i, device=x.device, dtype=x.dtype)
    if n == 0:
        return out
    c = config or DEFAULT_CONFIG
    x_desc = TensorDescriptor.from_tensor(x, [c.block_m, c.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    tiles = triton.cdiv(n, c.block_m) * triton.cdiv(i, c.block_n)
    programs = min(tiles, _sm_count(x.device)) if c.persistent else tiles
    _swiglu_gemm_kernel[(programs,)](
        x_desc, w_desc, bias, out_desc, n, i, e,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        NUM_STAGES=c.stages, num_warps=c.warps,
    )
    return out


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


if triton is not None:

    @triton.jit
    def _swiglu_gemm_kernel(
        x_desc, w_desc, bias_ptr, out_desc, M, I, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        # Tiles in grouped order (GROUP_M row tiles share each weight column band); a grid smaller than the
        # tile count makes each program loop (persistent), a grid of one program per tile runs it once.
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(I, BLOCK_N)
        tiles_per_group = GROUP_M * tiles_n
        k_steps = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
            first_m = (tile // tiles_per_group) * GROUP_M
            group_rows = min(tiles_m - first_m, GROUP_M)
            pid_m = first_m + (tile % tiles_per_group) % group_rows
            pid_n = (tile % tiles_per_group) // group_rows
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ks in tl.range(0, k_steps, num_stages=NUM_STAGES):
                off_k = ks * BLOCK_K
                a = x_desc.load([off_m, off_k])  # [BLOCK_M, BLOCK_K]
                gate = tl.dot(a, w_desc.load([off_n, off_k]).T, gate)  # weight rows [off_n, off_n + BLOCK_N)
                up = tl.dot(a, w_desc.load([I + off_n, off_k]).T, up)  # rows I + [off_n, ...)
            cols = off_n + tl.arange(0, BLOCK_N)
            keep = cols < I
            gate += tl.load(bias_ptr + cols, mask=keep, other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias_ptr + I + cols, mask=keep, other=0.0).to(tl.float32)[None, :]
            hidden = gate / (1.0 + tl.exp(-gate)) * up
            out_desc.store([off_m, off_n], hidden.to(out_desc.dtype))  # rows >= M, cols >= I clipped by TMA
