"""REJECTED: our head-dim-split Triton varlen attention kernel, kept here (not in the service) so that
benchmarks/attention/candidates.py can still measure it as a rejected candidate (`triton_split[<config>]`)
and benchmarks/attention/compile_check_sm90.py can still compile it. Nothing in encoder_service imports it.

Why it left production (H100, 2026-11-23: candidates.py and tests/gpu/test_ops_cuda.py):
  - slower than FlashAttention-4 on every layout, e.g. the Qwen3 1080p one-segment class: fa4 0.685 ms vs
    triton_split 1.969 ms in total; Qwen2.5 1080p: fa4 0.987 ms vs 2.472 ms;
  - WRONG on several layouts: relative error 5.7e-2 to 1.75e-1 against float32 on graph-padded and
    multi-segment cases (lengths (1380, 668) in 2 slots with max_seqlen 2048; (256, 256, 256, 256, 256, 240)
    with max_seqlen 256; windows), 192 NaN rows with config m64n64w4s2, and an illegal memory access / NaN
    rows with m128n128w8s2 and m128n64w4s3 at D = 72. The service's startup check (ops/attention.py) demoted
    it, so the service stayed correct, but a kernel known to be wrong does not stay in the package.
It was only ever selected by `--attention triton` (now gone: auto, fa4, torch). The short-segment window
kernel (ops/attention_triton.py: short_segment_attention) is correct and fastest for Qwen2.5's windows and
stays in production.

The design, as it was: any segment lengths, flash-style online softmax over key blocks, the head dim SPLIT
instead of padded: D = D0 + tail, D0 the largest power of two <= D (64 for 72 and 80), the tail a 16-wide
block whose columns >= D are masked loads of zeros (never read, never written):
    D = 80 -> 64 + 16 (exact)        D = 72 -> 64 + 16 (8 masked)        D = 64 -> 64
QK^T = q[:, :64] k[:, :64]^T + q[:, 64:] k[:, 64:]^T into one float32 accumulator; P @ V into two
([BLOCK_M, 64] and [BLOCK_M, 16]). 80 computed columns for 72 real ones instead of 128 (bf16 wgmma needs
K % 16 == 0, hence the 16-wide tail).
Scheduling: grid (block_slots, H) with block_slots = min(N // BLOCK_M + S, S * cdiv(max_seqlen, BLOCK_M))
(Python ints; bounds sum_i cdiv(len_i, BLOCK_M)). Each program loads cu_seqlens as one vector (S + 1 <=
SEG_P2 entries, hence at most SPLIT_MAX_SEGMENTS slots), takes the prefix sum of blocks per segment and
finds its (segment, query block) on the device; programs past the last block return. Zero-length and filler
slots own no block. Row offsets are int64 scalars per program (any N).

The op's contract is ops/attention.py's (q, k, v [N, H, D] with a unit last-dim stride, v possibly the
strided [:, 2] view of the fused qkv output; cu_seqlens int32 [S + 1] on the device; max_seqlen a Python int
>= every segment). Interpreter tests: benchmarks/attention/test_triton_split_interp.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encoder_service.ops.attention_triton import unit_last_stride
from encoder_service.ops.fast_path import tl, triton

LOG2E = 1.4426950408889634
# Each program loads every boundary: at most this many segment slots.
SPLIT_MAX_SEGMENTS = 1024


@dataclass(frozen=True)
class SplitConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"


# The four block configs measured on the H100 (no autotuner: nothing was to be timed at a first call or
# tuned during capture). m128n128w8s2 and m128n64w4s3 gave an illegal address / NaN rows at D = 72 on the
# unpadded 8 x 784 layout; m64n64w4s2 (its config for max_seqlen <= 64 while it was in the service) gave 192
# NaN rows; m128n64w8s2 was its config for longer segments.
SPLIT_CONFIGS = {c.name: c for c in (
    SplitConfig(128, 64, 8, 2),
    SplitConfig(64, 64, 4, 2),
    SplitConfig(128, 128, 8, 2),
    SplitConfig(128, 64, 4, 3),
)}


def split_config(max_seqlen: int) -> SplitConfig:
    """The default config (Python ints only): the one the service ran while the kernel was in production."""
    if max_seqlen <= 64:
        return SPLIT_CONFIGS["m64n64w4s2"]
    return SPLIT_CONFIGS["m128n64w8s2"]


def serves(num_segments: int, head_dim: int) -> bool:
    """Whether the kernel takes a layout (each program loads every boundary: at most SPLIT_MAX_SEGMENTS)."""
    return num_segments <= SPLIT_MAX_SEGMENTS and 16 <= head_dim <= 256


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(D0, D1): D0 = the largest power of two <= D, D1 = the width of the (masked) tail block, 0 if none."""
    if head_dim < 16:
        raise ValueError(f"head_dim {head_dim} < 16 is not supported")
    d0 = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - d0
    if rest == 0:
        return d0, 0
    return d0, max(16, 1 << (rest - 1).bit_length())


def seg_p2(num_segments: int) -> int:
    """Width of the cu_seqlens vector each program loads (a compile-time constant: few distinct values)."""
    return max(32, 1 << num_segments.bit_length())  # a power of two > num_segments


def num_block_slots(n_rows: int, num_segments: int, max_seqlen: int, block_m: int) -> int:
    """An upper bound of sum_i cdiv(len_i, block_m) over segments with sum len_i <= n_rows, len_i <= max_seqlen."""
    bound = n_rows // block_m + num_segments
    if max_seqlen > 0:
        bound = min(bound, num_segments * -(-max_seqlen // block_m))
    return max(bound, 0)


if triton is not None:

    @triton.jit
    def _split_block(
        acc0, acc1, m_i, l_i, q0, q1, k_ptrs0, k_ptrs1, v_ptrs0, v_ptrs1, n_mask, d1_mask, qk_scale,
        HAS_TAIL: tl.constexpr, TAIL_MASKED: tl.constexpr, MASK_N: tl.constexpr,
    ):
        """One key block: scores from the split head dim, online softmax update, P @ V into both accumulators.
        k_ptrs* are [D0 | D1, BLOCK_N] (k transposed), v_ptrs* [BLOCK_N, D0 | D1]."""
        if MASK_N:
            k0 = tl.load(k_ptrs0, mask=n_mask[None, :], other=0.0)
        else:
            k0 = tl.load(k_ptrs0)
        qk = tl.dot(q0, k0)
        if HAS_TAIL:
            if MASK_N:
                if TAIL_MASKED:
                    k1 = tl.load(k_ptrs1, mask=d1_mask[:, None] & n_mask[None, :], other=0.0)
                else:
                    k1 = tl.load(k_ptrs1, mask=n_mask[None, :], other=0.0)
            else:
                if TAIL_MASKED:
                    k1 = tl.load(k_ptrs1, mask=d1_mask[:, None], other=0.0)
                else:
                    k1 = tl.load(k_ptrs1)
            qk = tl.dot(q1, k1, qk)
        qk = qk * qk_scale  # log2 domain: softmax scale * log2(e) folded in
        if MASK_N:
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK_N:
            v0 = tl.load(v_ptrs0, mask=n_mask[:, None], other=0.0)
        else:
            v0 = tl.load(v_ptrs0)
        p_lo = p.to(v0.dtype)
        acc0 = tl.dot(p_lo, v0, acc0 * alpha[:, None])
        if HAS_TAIL:
            if MASK_N:
                if TAIL_MASKED:
                    v1 = tl.load(v_ptrs1, mask=n_mask[:, None] & d1_mask[None, :], other=0.0)
                else:
                    v1 = tl.load(v_ptrs1, mask=n_mask[:, None], other=0.0)
            else:
                if TAIL_MASKED:
                    v1 = tl.load(v_ptrs1, mask=d1_mask[None, :], other=0.0)
                else:
                    v1 = tl.load(v_ptrs1)
            acc1 = tl.dot(p_lo, v1, acc1 * alpha[:, None])
        return acc0, acc1, m_new, l_i

    @triton.jit
    def _kv_pointers(K, V, row, skn, svn, k_head, v_head, offs_d0, offs_d1,
                     BLOCK_N: tl.constexpr, ALIGN8: tl.constexpr):
        """Pointers of the key block starting at `row`: k transposed [D0 | D1, BLOCK_N], v [BLOCK_N, D0 | D1]."""
        k_off = tl.cast(row, tl.int64) * skn + k_head  # (row: a Python int in the interpreter)
        v_off = tl.cast(row, tl.int64) * svn + v_head
        if ALIGN8:
            k_off = tl.multiple_of(k_off, 8)
            v_off = tl.multiple_of(v_off, 8)
        cols = tl.arange(0, BLOCK_N)
        k_ptrs = K + k_off + cols[None, :] * skn
        v_ptrs = V + v_off + cols[:, None] * svn
        k0, k1 = k_ptrs + offs_d0[:, None], k_ptrs + offs_d1[:, None]
        return k0, k1, v_ptrs + offs_d0[None, :], v_ptrs + offs_d1[None, :]

    @triton.jit(do_not_specialize=["num_segments"])  # 1, 2, 33, 180 ... slots share one binary per SEG_P2
    def _split_head_attn_kernel(
        Q, K, V, O, CU,
        sqn, sqh, skn, skh, svn, svh, son, soh,
        num_segments, qk_scale,
        D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_TAIL: tl.constexpr, TAIL_MASKED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_P2: tl.constexpr, ALIGN8: tl.constexpr,
    ):
        pid = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)

        # (segment, query block) of this program, from cu_seqlens on the device.
        s_idx = tl.arange(0, SEG_P2)
        s_valid = s_idx < num_segments
        seg_lo = tl.load(CU + s_idx, mask=s_valid, other=0).to(tl.int32)
        seg_hi = tl.load(CU + s_idx + 1, mask=s_valid, other=0).to(tl.int32)
        nblk = tl.where(s_valid & (seg_hi > seg_lo), (seg_hi - seg_lo + BLOCK_M - 1) // BLOCK_M, 0)
        cum = tl.cumsum(nblk, 0)  # inclusive prefix sum of query blocks
        seg = tl.sum((cum <= pid).to(tl.int32), 0)  # the first segment whose blocks reach past pid
        if seg >= num_segments:
            return
        blk_before = tl.sum(tl.where(s_idx == seg, cum - nblk, 0), 0)
        start = tl.load(CU + seg).to(tl.int32)
        end = tl.load(CU + seg + 1).to(tl.int32)
        m_start = start + (pid - blk_before) * BLOCK_M

        # Scalar int64 bases (rows * row stride may pass 2^31), int32 offsets inside the tile. With D = 72
        # the head stride is not a multiple of 16, which Triton cannot prove aligned (it only specialises
        # % 16): every load became 2-byte scalar loads without cp.async. The host checks strides % 8 == 0
        # and 16-byte base pointers (ALIGN8) and the hint restores 16-byte vectors.
        q_off = m_start.to(tl.int64) * sqn + h * sqh
        o_off = m_start.to(tl.int64) * son + h * soh
        k_head = h * skh
        v_head = h * svh
        if ALIGN8:
            q_off = tl.multiple_of(q_off, 8)
            o_off = tl.multiple_of(o_off, 8)
            k_head = tl.multiple_of(k_head, 8)
            v_head = tl.multiple_of(v_head, 8)
        rows = tl.arange(0, BLOCK_M)
        m_mask = (m_start + rows) < end
        offs_d0 = tl.arange(0, D0)
        offs_d1 = D0 + tl.arange(0, D1)
        d1_mask = offs_d1 < D
        q_ptrs = Q + q_off + rows[:, None] * sqn
        q0 = tl.load(q_ptrs + offs_d0[None, :], mask=m_mask[:, None], other=0.0)
        if HAS_TAIL:
            if TAIL_MASKED:
                q1 = tl.load(q_ptrs + offs_d1[None, :], mask=m_mask[:, None] & d1_mask[None, :], other=0.0)
            else:
                q1 = tl.load(q_ptrs + offs_d1[None, :], mask=m_mask[:, None], other=0.0)
        else:
            q1 = q0  # unused

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)

        # Full key blocks (no masks), then one masked tail block.
        full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
        for start_n in range(start, full_end, BLOCK_N):
            k0p, k1p, v0p, v1p = _kv_pointers(K, V, start_n, skn, svn, k_head, v_head, offs_d0, offs_d1,
                                              BLOCK_N, ALIGN8)
            acc0, acc1, m_i, l_i = _split_block(  # MASK_N False: the n_mask argument is not read
                acc0, acc1, m_i, l_i, q0, q1, k0p, k1p, v0p, v1p, d1_mask, d1_mask, qk_scale,
                HAS_TAIL, TAIL_MASKED, False,
            )
        if full_end < end:
            k0p, k1p, v0p, v1p = _kv_pointers(K, V, full_end, skn, svn, k_head, v_head, offs_d0, offs_d1,
                                              BLOCK_N, ALIGN8)
            n_mask = (full_end + tl.arange(0, BLOCK_N)) < end
            acc0, acc1, m_i, l_i = _split_block(
                acc0, acc1, m_i, l_i, q0, q1, k0p, k1p, v0p, v1p, n_mask, d1_mask, qk_scale,
                HAS_TAIL, TAIL_MASKED, True,
            )

        # Every row of a non-empty segment saw >= 1 key, so l_i > 0 (rows past `end` are masked out below).
        inv_l = 1.0 / l_i
        o_ptrs = O + o_off + rows[:, None] * son
        tl.store(o_ptrs + offs_d0[None, :], (acc0 * inv_l[:, None]).to(O.dtype.element_ty), mask=m_mask[:, None])
        if HAS_TAIL:
            out1 = (acc1 * inv_l[:, None]).to(O.dtype.element_ty)
            if TAIL_MASKED:
                tl.store(o_ptrs + offs_d1[None, :], out1, mask=m_mask[:, None] & d1_mask[None, :])
            else:
                tl.store(o_ptrs + offs_d1[None, :], out1, mask=m_mask[:, None])


def _aligned8(*ts: torch.Tensor) -> bool:
    """16-bit elements, unit last-dim stride, the other strides % 8 == 0 and 16-byte base pointers: every
    (row, head) vector then starts 16-byte aligned, which the kernel tells Triton with tl.multiple_of."""
    return all(
        t.element_size() == 2 and t.stride(2) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0
        and t.data_ptr() % 16 == 0
        for t in ts
    )


def split_head_attention(q, k, v, cu_seqlens, max_seqlen: int, *, config: SplitConfig | None = None, out=None):
    """Packed varlen attention, head dim split (module docstring); q, k, v [N, H, D] -> [N, H, D]. At most
    SPLIT_MAX_SEGMENTS segment slots; 16 <= D <= 256. `config`: one of SPLIT_CONFIGS (default: split_config)."""
    q, k, v = unit_last_stride(q, k, v)
    n, h, d = q.shape
    num_segments = cu_seqlens.shape[0] - 1
    if num_segments > SPLIT_MAX_SEGMENTS:
        raise ValueError(f"{num_segments} segment slots: split_head_attention takes at most {SPLIT_MAX_SEGMENTS}")
    if out is None:
        out = torch.empty(n, h, d, device=q.device, dtype=q.dtype)
    cfg = config or split_config(max_seqlen)
    d0, d1 = split_head_dim(d)
    slots = num_block_slots(n, num_segments, int(max_seqlen), cfg.block_m)
    if n == 0 or num_segments <= 0 or slots == 0:
        return out
    _split_head_attn_kernel[(slots, h)](
        q, k, v, out, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        num_segments, d**-0.5 * LOG2E,
        D=d, D0=d0, D1=max(d1, 16), HAS_TAIL=d1 > 0, TAIL_MASKED=d1 > 0 and d0 + d1 != d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SEG_P2=seg_p2(num_segments), ALIGN8=_aligned8(q, k, v, out),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
