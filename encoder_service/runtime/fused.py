"""The tower's fast path, installed once at runner setup by `prepare_tower(tower)`.

Two things, both leaving the towers' files (models/) untouched:

1. MLP width padding (load-time, every device). The Qwen2.5 down projection has K = 3420, not a multiple
   of 64, and ran at a quarter of the other GEMMs' rate on an H100 (docs: DESIGN.md section 3). Padding the
   MLP intermediate width I to a multiple of 128 with zeros is exact: the extra gate/up (fc1) rows are zero
   with zero bias, so the extra hidden columns are act(0) * 0 = 0 (silu, gelu, quick_gelu all map 0 to 0),
   and the extra down (fc2) columns are zero, so they add exact zeros to every dot product. The gated MLP's
   gate and up projections are also fused into one [2 * I_pad, E] weight (one GEMM instead of two).

2. Fused CUDA forwards (bf16/fp16 on CUDA with Triton; everywhere else the towers' own code runs unchanged,
   so CPU results are the towers' results). Per block, on the GPU:
       n1, c1 = norm1(x), x + proj.bias                     one Triton kernel (reads x once)
       qkv    = n1 @ Wqkv^T + b                             cuBLAS
       q, k   = rotary(qkv) in float32                      one Triton kernel (was ~20 eager kernels)
       o      = attention(q, k, v)                          runtime/attention.py dispatch
       x1     = c1 + o @ Wproj^T                            one GEMM, residual in the epilogue (in place, beta 1)
       n2, c2 = norm2(x1), x1 + down.bias                   one Triton kernel
       h      = silu(n2 @ Wg^T) * (n2 @ Wu^T)               one GEMM + one Triton kernel (Qwen2.5)
              | gelu_tanh(n2 @ W1^T + b1)                   one GEMM with cuBLASLt's GELU epilogue (Qwen3)
       x      = c2 + h @ Wdown^T                            one GEMM, residual in the epilogue
   The residual adds ride in the GEMMs (bias folded into the residual by the norm kernel), so a block
   makes two elementwise passes over [N, E] besides rotary and the activation.
   Qwen3's learned position embedding (4 taps weighted in float32, added to the patch embedding) is one
   kernel too (the tower's forward is swapped for an equivalent one that calls it).
   Numerics differ from the towers' eager order by rounding only (one bf16 rounding instead of two for the
   residual adds); parity with transformers is checked in bf16 at full size by benchmarks/gpu_parity.py.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from encoder_service.models.layers import RMSNorm, VisionAttention, VisionBlock
from encoder_service.models.qwen3_vl import Qwen3VLTower
from encoder_service.runtime.attention import varlen_attention

log = logging.getLogger(__name__)

MLP_PAD_MULTIPLE = 128

try:  # Triton ships with the CUDA builds of torch; the CPU build has none.
    from encoder_service.runtime import kernels as _kernels
except ImportError:
    _kernels = None


def fast_path(x: torch.Tensor) -> bool:
    return _kernels is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- 1. MLP padding -------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    if t is None or t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    if t.shape[1] == cols:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], cols - t.shape[1])], dim=1)


class GatedMLP(nn.Module):
    """Qwen2.5's act(gate(x)) * up(x) -> down, with gate and up in one [2 * I_pad, E] weight (gate rows
    first) and the intermediate width zero-padded to I_pad."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act, multiple: int):
        super().__init__()
        self.intermediate_size = gate.out_features
        self.padded_size = round_up(self.intermediate_size, multiple)
        p = self.padded_size
        self.gate_up_weight = nn.Parameter(
            torch.cat([_pad_rows(gate.weight.data, p), _pad_rows(up.weight.data, p)]), requires_grad=False
        )
        self.gate_up_bias = nn.Parameter(
            torch.cat([_pad_rows(gate.bias.data, p), _pad_rows(up.bias.data, p)]), requires_grad=False
        )
        self.down_weight = nn.Parameter(_pad_cols(down.weight.data, p), requires_grad=False)
        self.down_bias = nn.Parameter(down.bias.data, requires_grad=False)
        self.act = act

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        p = self.padded_size
        if fast_path(x) and self.act is F.silu:
            return _kernels.silu_mul(F.linear(x, self.gate_up_weight, self.gate_up_bias))
        gate = F.linear(x, self.gate_up_weight[:p], self.gate_up_bias[:p])
        up = F.linear(x, self.gate_up_weight[p:], self.gate_up_bias[p:])
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden(x), self.down_weight, self.down_bias)


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))) (Qwen2 quick_gelu, Qwen3 tanh GELU) with the width zero-padded."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, act, multiple: int):
        super().__init__()
        self.intermediate_size = fc1.out_features
        self.padded_size = round_up(self.intermediate_size, multiple)
        p = self.padded_size
        self.up_weight = nn.Parameter(_pad_rows(fc1.weight.data, p), requires_grad=False)
        self.up_bias = nn.Parameter(_pad_rows(fc1.bias.data, p), requires_grad=False)
        self.down_weight = nn.Parameter(_pad_cols(fc2.weight.data, p), requires_grad=False)
        self.down_bias = nn.Parameter(fc2.bias.data, requires_grad=False)
        self.act = act
        from encoder_service.models.layers import gelu_tanh

        self.gelu_tanh = act is gelu_tanh

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        if fast_path(x) and self.gelu_tanh:
            # cuBLASLt's GELU epilogue is the tanh approximation: bias + GELU ride in the GEMM.
            return torch._addmm_activation(self.up_bias, x, self.up_weight.t(), use_gelu=True)
        return self.act(F.linear(x, self.up_weight, self.up_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden(x), self.down_weight, self.down_bias)


def padded_mlp(mlp: nn.Module, multiple: int) -> nn.Module | None:
    """The padded replacement of one of the towers' MLPs, or None for an unknown module."""
    if all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
        return GatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act, multiple)
    for fc1, fc2 in (("linear_fc1", "linear_fc2"), ("fc1", "fc2")):
        if hasattr(mlp, fc1) and hasattr(mlp, fc2) and hasattr(mlp, "act"):
            return PlainMLP(getattr(mlp, fc1), getattr(mlp, fc2), mlp.act, multiple)
    return None


# ---- 2. fused block forward -----------------------------------------------------------------------


def _norm_params(norm: nn.Module):
    """(weight, bias, eps, is_rms) of the towers' RMSNorm or an nn.LayerNorm; None if neither."""
    if isinstance(norm, RMSNorm):
        return norm.weight, None, norm.eps, True
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine:
        return norm.weight, norm.bias, norm.eps, False
    return None


class FusedVisionBlock(VisionBlock):
    """VisionBlock with the fused CUDA forward above; the towers' forward everywhere else."""

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        if not fast_path(x):
            return super().forward(x, cos, sin, cu_seqlens, max_seqlen)
        n = x.shape[0]
        attn, mlp = self.attn, self.mlp
        w1, b1, eps1, rms1 = _norm_params(self.norm1)
        w2, b2, eps2, rms2 = _norm_params(self.norm2)
        c1, n1 = _kernels.norm_residual(x, w1, b1, eps1, rms1, attn.proj.bias)
        qkv = F.linear(n1, attn.qkv.weight, attn.qkv.bias)
        q, k = _kernels.rotary_qk(qkv, cos, sin, attn.num_heads)
        v = qkv.view(n, 3, attn.num_heads, -1)[:, 2]
        o = varlen_attention(q, k, v, cu_seqlens, max_seqlen)
        # In place (c1 is this block's own buffer): out-of-place addmm would first copy c1 into a new output.
        x1 = c1.addmm_(o.reshape(n, -1), attn.proj.weight.t())
        c2, n2 = _kernels.norm_residual(x1, w2, b2, eps2, rms2, mlp.down_bias)
        return c2.addmm_(mlp.hidden(n2), mlp.down_weight.t())


def _fused_qwen3_forward(tower, pixel_values, meta):
    """Qwen3VLTower.forward with the position-embedding lookup, float32 weighting and add in one kernel
    (eager: ~6 kernels over [N, 4, E] float32)."""
    x = tower.patch_embed(pixel_values)
    x = _kernels.pos_embed_add(x, tower.pos_embed.weight, meta.pos_indices, meta.pos_weights)
    deepstack = []
    for i, block in enumerate(tower.blocks):
        x = block(x, meta.cos, meta.sin, meta.cu_seqlens, meta.max_seqlen)
        if i in tower.deepstack_after_block:
            deepstack.append(tower.deepstack_merger_list[tower.deepstack_after_block[i]](x))
    return torch.cat([tower.merger(x), *deepstack], dim=1)


class FusedQwen3VLTower(Qwen3VLTower):
    """Qwen3VLTower with `_fused_qwen3_forward` on the fast path; the towers' forward everywhere else."""

    def forward(self, pixel_values, meta):
        if fast_path(self.pos_embed.weight):
            return _fused_qwen3_forward(self, pixel_values, meta)
        return super().forward(pixel_values, meta)


def _fusable_block(block: nn.Module) -> bool:
    return (
        type(block) is VisionBlock
        and type(block.attn) is VisionAttention
        and isinstance(block.mlp, (GatedMLP, PlainMLP))
        and _norm_params(block.norm1) is not None
        and _norm_params(block.norm2) is not None
    )


def prepare_tower(tower: nn.Module, *, pad_multiple: int = MLP_PAD_MULTIPLE, fuse: bool = True) -> dict:
    """Pad the MLPs and install the fused block forward, in place, once (a second call is a no-op).
    Returns what it did, for the startup log."""
    if getattr(tower, "_fast_path_prepared", False):
        return tower._fast_path_prepared
    report = {"mlp_padded": None, "fused_blocks": 0, "triton": _kernels is not None}
    for block in getattr(tower, "blocks", []):
        mlp = padded_mlp(block.mlp, pad_multiple) if pad_multiple else None
        if mlp is not None:
            report["mlp_padded"] = f"{mlp.intermediate_size} -> {mlp.padded_size}"
            block.mlp = mlp
        if fuse and _fusable_block(block):
            block.__class__ = FusedVisionBlock  # same parameters, fused forward
            report["fused_blocks"] += 1
    if fuse:
        report["fused_pos_embed"] = type(tower) is Qwen3VLTower
        if report["fused_pos_embed"]:
            tower.__class__ = FusedQwen3VLTower  # same parameters, fused forward
    tower._fast_path_prepared = report
    log.info("fast path: %s", report)
    return report
