"""Which attention kernel for which layout, and what the fused kernels buy (H100, bf16, 16 heads).

For the attention layouts of the towers (one long segment; one image + graph padding; Qwen2.5 windows;
several images), times every candidate the GPU machine offers and checks each against a float32 reference:
`torch.nn.attention.varlen.varlen_attn`, dense `scaled_dot_product_attention` per backend (flash, cuDNN,
efficient), the two-segment dense trick (ops/attention.py), batched dense for equal images, and our
Triton short-segment kernel (ops/attention_triton.py). Also: the padded MLP GEMMs and the fused elementwise
kernels (ops/) against the eager torch ops they replace.

    python -m benchmarks.attention.kernels      # GPU only

Writes benchmarks/results/attention_kernels-<date>-<commit>.json and $OUT/attention_kernels.md
(benchmarks/common/report.py: where, with and without OUT).

benchmarks/attention/candidates.py is issue 14's comparison of the attention backends (FlashAttention-4,
cudnn-frontend, torch's, and our rejected head-dim-split Triton kernel) on the graphs' real layouts,
crash-isolated.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common.report import stamp, write_result
from encoder_service.models.layers import RMSNorm
from encoder_service.models.metadata import MULTI, PaddedShape, build_batch_metadata
from encoder_service.ops import attention, attention_triton, mlp_kernels, norm, pos_embed, rotary

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

DEV, DT, H = "cuda", torch.bfloat16, 16
rows: list[dict] = []


def bench(fn) -> float:
    from triton.testing import do_bench  # GPU only: imported when measuring, not for --help

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference(q, k, v, bounds):
    """float32 attention per segment, the service's own reference (rows past bounds[-1] are not written)."""
    return attention.reference_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32))


def attn_flops(bounds, d) -> float:
    return sum(4.0 * (e - s) ** 2 * d * H for s, e in zip(bounds[:-1], bounds[1:]))


def record(layout, variant, fn, ref, real_rows, flops):
    try:
        out = fn()
        err = rel(out[:real_rows], ref[:real_rows])
        ms = bench(fn)
        row = dict(layout=layout, variant=variant, ms=ms, tflops=flops / ms / 1e9, rel_err=err)
    except Exception as e:  # a backend that refuses the shape
        row = dict(layout=layout, variant=variant, ms=None, tflops=None, rel_err=None, error=str(e)[:160])
    rows.append(row)
    print(json.dumps(row), flush=True)


def dense(q, k, v, backend=None, scale=None):
    args = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    if backend is None:
        return F.scaled_dot_product_attention(*args, scale=scale).squeeze(0).transpose(0, 1)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(*args, scale=scale).squeeze(0).transpose(0, 1)


def two_segment(q, k, v, cu, backend=None):
    """ops/attention.py's two-segment dense trick, its SDPA call on `backend` (None: torch's choice)."""
    if backend is None:
        return attention.two_segment_dense_attention(q, k, v, cu)
    with sdpa_kernel([backend]):
        return attention.two_segment_dense_attention(q, k, v, cu)


BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def qkv(n, d):
    return [torch.randn(n, H, d, device=DEV, dtype=DT) for _ in range(3)]


def one_segment(name, n, d, bucket):
    q, k, v = qkv(bucket, d)
    bounds = [0, n]
    ref = reference(q, k, v, bounds)
    fl = attn_flops(bounds, d)
    cu = torch.tensor(bounds, device=DEV, dtype=torch.int32)
    if varlen_attn is not None:
        record(name, "varlen_attn", lambda: varlen_attn(q[:n], k[:n], v[:n], cu, cu, n, n), ref, n, fl)
    record(name, "dense sdpa (default)", lambda: dense(q[:n], k[:n], v[:n]), ref, n, fl)
    for b, backend in BACKENDS.items():
        record(name, f"dense sdpa {b}", lambda: dense(q[:n], k[:n], v[:n], backend), ref, n, fl)
    # In a graph: the image plus padding rows up to the bucket, two segments, max_seqlen = bucket.
    cu2 = torch.tensor([0, n, bucket], device=DEV, dtype=torch.int32)
    record(name, f"graph {bucket}: two-segment dense (default)", lambda: two_segment(q, k, v, cu2), ref, n, fl)
    for b, backend in BACKENDS.items():
        record(name, f"graph {bucket}: two-segment dense {b}", lambda: two_segment(q, k, v, cu2, backend), ref, n, fl)
    cu33 = torch.tensor([0, n] + [bucket] * 32, device=DEV, dtype=torch.int32)
    if varlen_attn is not None:
        record(name, f"graph {bucket}: varlen_attn, 33 slots, max_seqlen {bucket}",
               lambda: varlen_attn(q, k, v, cu33, cu33, bucket, bucket), ref, n, fl)


def windows(name, grid, d, bucket):
    meta = build_batch_metadata([grid], merge=2, head_dim=d, rope_theta=10000.0, window_units=4)
    bounds = meta.cu_window_seqlens.tolist()
    n = bounds[-1]
    q, k, v = qkv(bucket, d)
    ref = reference(q, k, v, bounds)
    fl = attn_flops(bounds, d)
    cu = meta.cu_window_seqlens.to(DEV)
    if varlen_attn is not None:
        record(name, "varlen_attn, max_seqlen 64", lambda: varlen_attn(q[:n], k[:n], v[:n], cu, cu, 64, 64), ref, n, fl)
    record(name, "triton short-segment",
           lambda: attention_triton.short_segment_attention(q[:n], k[:n], v[:n], cu, 64), ref, n, fl)
    # In a (multi) graph: dummy windows of 64 rows up to the bucket, the graph's window slots.
    shape = PaddedShape.for_graph(bucket, MULTI, max_images=32, merge_unit=4, window_units=4)
    slots = shape.window_slots
    cup = meta.padded(shape).cu_window_seqlens.to(DEV)
    record(name, f"graph {bucket}: triton short-segment, {slots} slots",
           lambda: attention_triton.short_segment_attention(q, k, v, cup, 64), ref, n, fl)
    if varlen_attn is not None:
        record(name, f"graph {bucket}: varlen_attn, {slots} slots",
               lambda: varlen_attn(q, k, v, cup, cup, 64, 64), ref, n, fl)


def several(name, count, length, d, bucket):
    n = count * length
    q, k, v = qkv(bucket, d)
    bounds = [i * length for i in range(count + 1)]
    ref = reference(q, k, v, bounds)
    fl = attn_flops(bounds, d)
    cu = torch.tensor(bounds, device=DEV, dtype=torch.int32)
    if varlen_attn is not None:
        record(name, "varlen_attn exact", lambda: varlen_attn(q[:n], k[:n], v[:n], cu, cu, length, length), ref, n, fl)
        slots = 33
        cup = torch.tensor(bounds + [bucket] * (slots + 1 - len(bounds)), device=DEV, dtype=torch.int32)
        record(name, f"graph {bucket}: varlen_attn {slots} slots, max_seqlen {bucket}",
               lambda: varlen_attn(q, k, v, cup, cup, bucket, bucket), ref, n, fl)
        record(name, f"graph {bucket}: varlen_attn {slots} slots, max_seqlen {bucket // 4}",
               lambda: varlen_attn(q, k, v, cup, cup, bucket // 4, bucket // 4), ref, n, fl)

    def batched(backend=None):
        args = [x[:n].view(count, length, H, d).transpose(1, 2) for x in (q, k, v)]
        if backend is None:
            o = F.scaled_dot_product_attention(*args)
        else:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(*args)
        return o.transpose(1, 2).reshape(n, H, d)

    record(name, "batched dense (default)", batched, ref, n, fl)
    record(name, "batched dense cudnn", lambda: batched(SDPBackend.CUDNN_ATTENTION), ref, n, fl)


def gemms():
    out = []
    for label, m, k, n in [
        ("Qwen2.5 down K=3420", 10764, 3420, 1280), ("Qwen2.5 down K=3456 (padded)", 10764, 3456, 1280),
        ("Qwen2.5 gate+up N=6840", 10764, 1280, 6840), ("Qwen2.5 gate+up N=6912 (padded)", 10764, 1280, 6912),
        ("Qwen3 fc2 K=4304", 8160, 4304, 1152), ("Qwen3 fc2 K=4352 (padded)", 8160, 4352, 1152),
        ("Qwen3 fc1 N=4304", 8160, 1152, 4304), ("Qwen3 fc1 N=4352 (padded)", 8160, 1152, 4352),
        ("Qwen2.5 patch embed K=1176", 10764, 1176, 1280), ("Qwen3 qkv", 8160, 1152, 3456),
        ("Qwen2.5 qkv M=1024", 1024, 1280, 3840), ("Qwen2.5 proj M=1024", 1024, 1280, 1280),
        ("Qwen2.5 gate+up M=1024", 1024, 1280, 6912), ("Qwen2.5 down M=1024", 1024, 3456, 1280),
        ("matmul 8192^3", 8192, 8192, 8192),
    ]:
        a = torch.randn(m, k, device=DEV, dtype=DT)
        b = torch.randn(n, k, device=DEV, dtype=DT)
        ms = bench(lambda: F.linear(a, b))
        out.append(dict(gemm=label, m=m, k=k, n=n, ms=ms, tflops=2 * m * k * n / ms / 1e9))
        print(json.dumps(out[-1]), flush=True)
    return out


def elementwise():
    out = []
    n, e, d = 10764, 1280, 80
    x = torch.randn(n, e, device=DEV, dtype=DT)
    w = torch.randn(e, device=DEV, dtype=DT)
    b = torch.randn(e, device=DEV, dtype=DT)
    rms = RMSNorm(e).to(DEV, DT)
    rms.weight.data.copy_(w)
    ref = rms(x)
    got, _ = norm.norm_residual_triton(x, w, None, 1e-6, True, b)
    out.append(dict(op="RMSNorm [10764,1280]", eager_ms=bench(lambda: rms(x)),
                    fused_ms=bench(lambda: norm.norm_residual_triton(x, w, None, 1e-6, True, b)),
                    rel_err=rel(got, ref), note="fused also writes x + bias"))
    ln_ref = F.layer_norm(x, (e,), w, b, 1e-6)
    got, _ = norm.norm_residual_triton(x, w, b, 1e-6, False, b)
    out.append(dict(op="LayerNorm [10764,1280]", eager_ms=bench(lambda: F.layer_norm(x, (e,), w, b, 1e-6)),
                    fused_ms=bench(lambda: norm.norm_residual_triton(x, w, b, 1e-6, False, b)),
                    rel_err=rel(got, ln_ref)))
    qkv_out = torch.randn(n, 3 * e, device=DEV, dtype=DT)
    cos, sin = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV)

    def eager_rotary():
        q, k, _ = qkv_out.view(n, 3, H, d).unbind(1)
        return rotary.apply_rotary(q, k, cos, sin)

    rq, rk = eager_rotary()
    fq, fk = rotary.rotary_qk_triton(qkv_out, cos, sin, H)
    out.append(dict(op="rotary q,k [10764,16,80]", eager_ms=bench(eager_rotary),
                    fused_ms=bench(lambda: rotary.rotary_qk_triton(qkv_out, cos, sin, H)),
                    rel_err=max(rel(fq, rq), rel(fk, rk))))
    gu = torch.randn(n, 2 * 3456, device=DEV, dtype=DT)
    ref = F.silu(gu[:, :3456]) * gu[:, 3456:]
    out.append(dict(op="silu(gate)*up [10764,3456]", eager_ms=bench(lambda: F.silu(gu[:, :3456]) * gu[:, 3456:]),
                    fused_ms=bench(lambda: mlp_kernels.silu_mul_triton(gu)),
                    rel_err=rel(mlp_kernels.silu_mul_triton(gu), ref)))
    n3, e3, i3 = 8160, 1152, 4352
    h = torch.randn(n3, e3, device=DEV, dtype=DT)
    w1 = torch.randn(i3, e3, device=DEV, dtype=DT) * 0.03
    b1 = torch.randn(i3, device=DEV, dtype=DT)
    ref = F.gelu(F.linear(h, w1, b1), approximate="tanh")
    got = torch._addmm_activation(b1, h, w1.t(), use_gelu=True)
    out.append(dict(op="fc1 + gelu_tanh [8160,1152]x[1152,4352]",
                    eager_ms=bench(lambda: F.gelu(F.linear(h, w1, b1), approximate="tanh")),
                    fused_ms=bench(lambda: torch._addmm_activation(b1, h, w1.t(), use_gelu=True)),
                    rel_err=rel(got, ref)))
    table = torch.randn(2304, e3, device=DEV, dtype=DT)
    idx = torch.randint(0, 2304, (n3, 4), device=DEV)
    pw = torch.rand(n3, 4, device=DEV)
    xe = torch.randn(n3, e3, device=DEV, dtype=DT)

    def eager_pos():
        return xe + (F.embedding(idx, table) * pw[:, :, None]).sum(1).to(DT)

    out.append(dict(op="Qwen3 pos-embed add [8160,1152]", eager_ms=bench(eager_pos),
                    fused_ms=bench(lambda: pos_embed.pos_embed_add_triton(xe, table, idx, pw)),
                    rel_err=rel(pos_embed.pos_embed_add_triton(xe, table, idx, pw), eager_pos())))
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def markdown(gemm_rows, ew_rows) -> str:
    lines = ["| layout | variant | ms | TFLOP/s | rel err vs fp32 |", "|---|---|---|---|---|"]
    for r in rows:
        if r["ms"] is None:
            lines.append(f"| {r['layout']} | {r['variant']} | n/a ({r.get('error', '')[:60]}) | | |")
        else:
            lines.append(f"| {r['layout']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['rel_err']:.1e} |")
    lines += ["", "| GEMM | M x K x N | ms | TFLOP/s |", "|---|---|---|---|"]
    lines += [f"| {g['gemm']} | {g['m']} x {g['k']} x {g['n']} | {g['ms']:.3f} | {g['tflops']:.0f} |"
              for g in gemm_rows]
    lines += ["", "| op | eager ms | fused ms | rel err |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['eager_ms']:.3f} | {r['fused_ms']:.3f} | {r['rel_err']:.1e} |" for r in ew_rows]
    return "\n".join(lines) + "\n"


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    setup = stamp() | dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    print(json.dumps(setup), flush=True)
    one_segment("Qwen2.5 1080p full (D=80)", 10764, 80, 12288)
    one_segment("Qwen3 1080p full (D=72)", 8160, 72, 8192)
    one_segment("Qwen3 720p full (D=72)", 3680, 72, 4096)
    windows("Qwen2.5 1080p windows (D=80)", (1, 78, 138), 80, 12288)
    several("Qwen3 8 x 448x448 (D=72)", 8, 784, 72, 7168)
    several("Qwen2.5 8 x 448x448 full (D=80)", 8, 1024, 80, 8192)
    g = gemms()
    ew = elementwise()
    md = markdown(g, ew)
    write_result("attention_kernels", setup, dict(attention=rows, gemm=g, elementwise=ew), md)
    print(md)


if __name__ == "__main__":
    main()
