"""Per-kernel candidates on the H100, each against float32, timed as a CUDA-graph replay (measure.bench_call).

Items are named "<group>/<shape>/<candidate>":
  mlp/<q25_1080p|q25_8x448>/...   Qwen2.5's gate/up projection + SwiGLU, x [M, 1280] -> [M, 3456]:
      cublas_gemm_only   the GEMM alone ([M, 6912], reference: the float32 GEMM): the floor of every fused kernel
      split              the service before issue 23: cuBLAS GEMM, then our Triton silu_mul (ops/mlp_kernels.py)
      triton_fused[cfg]  ops/swiglu_gemm_triton.py per tile config (its CONFIGS)
      quack[cfg]         ops/quack_gemm.py (quack gemm_act, swiglu epilogue, concat [gate; up]) per config
      inductor, inductor_max_autotune
                         torch.compile of the reference form (two GEMMs on the halves, silu, product): inductor
                         may fuse the product into the second GEMM's epilogue (reading the first's output)
  fc1/q3_1080p/...       Qwen3's fc1 + tanh GELU, [8160, 1152] -> [8160, 4352]: cublaslt_gelu (before issue 23:
                         torch._addmm_activation) vs quack_gelu (gemm_act "gelu_tanh_approx")
  fc1/q2_1080p/...       Qwen2's fc1 + quick_gelu, [10764, 1280] -> [10764, 5120]: torch_quick_gelu (cuBLAS,
                         then the activation in torch ops) vs quack_quick_gelu (gemm_act "quick_gelu")
  norm/q25_1080p/...     RMSNorm of [10764, 1280]: ours (Triton norm + residual, two outputs) vs quack rmsnorm
  attn/<layout>/...      attention, 16 heads, q/k contiguous, v the strided [:, 2] view of a fused qkv:
      fa4                as the service calls it (ops/attention_fa4.py: flash_attn_varlen_func)
      fa4_tiles[m,n,rs,ol]  FA4's internal _flash_attn_fwd with an explicit tile (tile_m x tile_n), P in
                         registers (rs) or shared memory, intra-warpgroup overlap (ol) or not
      fa4_dense          flash_attn_func on [1, N, H, D] (one segment only; FA4's static persistent scheduler)
      fa4_pad80          72 zero-padded to 80 by us (exact: zero columns add nothing to q.k and give zero
                         output columns), FA4 at D = 80, sliced back (copies included)
      cudnn_dense        torch SDPA forced to cuDNN on [1, H, N, D] (one segment only)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from benchmarks.mlp_kernels.measure import bench_call

E25, I25 = 1280, 3456  # Qwen2.5-VL-7B: hidden, padded MLP width (3420 -> 3456)
E3, I3 = 1152, 4352  # Qwen3-VL-8B: hidden, padded fc1 width (4304 -> 4352)
E2, I2, M2 = 1280, 5120, 10764  # Qwen2-VL-7B: hidden, fc1 width (mlp_ratio 4), 1080p patches
MLP_SHAPES = {"q25_1080p": 10764, "q25_8x448": 8192}
QUACK_CONFIGS = {  # quack.gemm_config.GemmConfig fields; "default": quack's own sm90 default (128 x 192 pingpong)
    "default": None,
    "m256n192co": dict(tile_m=256, tile_n=192, pingpong=False, cluster_m=2, cluster_n=1, is_dynamic_persistent=False),
    "m256n128co": dict(tile_m=256, tile_n=128, pingpong=False, cluster_m=2, cluster_n=1, is_dynamic_persistent=False),
    "m128n192pp_c1x2": dict(tile_m=128, tile_n=192, pingpong=True, cluster_m=1, cluster_n=2,
                            is_dynamic_persistent=False),
}
# FA4 sm90 forward tiles (tile_m, tile_n, P in registers, intra-warpgroup overlap). FA4's own choice for head
# dims 65..96 non-causal is (192, 144, False, True) (flash_attn/cute/interface.py: _tile_size_fwd_sm90).
FA4_TILES = [(192, 144, False, True), (128, 128, True, True), (128, 128, False, True), (128, 176, False, True),
             (192, 128, False, True), (128, 144, False, True)]
FA4_TILES_D80 = [(192, 144, False, True), (128, 128, True, True), (128, 176, False, True)]
HEADS = 16


def tile_name(t) -> str:
    m, n, rs, ol = t
    return f"fa4_tiles[{m},{n},{'rs' if rs else 'smem'},{'ol' if ol else 'no-ol'}]"


def parse_tile(name: str) -> tuple[int, int, bool, bool]:
    m, n, rs, ol = name[name.index("[") + 1 : -1].split(",")
    return int(m), int(n), rs == "rs", ol == "ol"


def attention_layouts() -> dict[str, dict]:
    """name -> D, cu (segment bounds), max_seqlen. q3_4x720p_multi: four 720p images in the 14400-row multi
    graph the service fills at concurrency 64 (models/metadata.py's padding: a dummy segment, filler slots)."""
    from encoder_service.models.metadata import MULTI, PaddedShape, build_batch_metadata

    meta = build_batch_metadata([(1, 44, 80)] * 4, merge=2, head_dim=72, rope_theta=10000.0)
    meta = meta.padded(PaddedShape.for_graph(14400, MULTI, max_images=32, merge_unit=4, window_units=None))
    return {
        "q3_1080p": dict(D=72, cu=[0, 8160], max_seqlen=8160),
        "q3_720p": dict(D=72, cu=[0, 3520], max_seqlen=3520),
        "q3_3680": dict(D=72, cu=[0, 3680], max_seqlen=3680),
        "q3_4x720p_multi": dict(D=72, cu=meta.cu_seqlens.tolist(), max_seqlen=meta.max_seqlen),
        "q25_1080p": dict(D=80, cu=[0, 10764], max_seqlen=10764),
    }


NEW = ["fc1/q2_1080p/torch_quick_gelu", "fc1/q2_1080p/quack_quick_gelu"]  # not measured before (call 2)


def items(sweep: bool = False) -> list[str]:
    """The kernels not measured yet (NEW); `sweep`: every item, in priority passes (a run cut by its time
    budget has the essentials): 1. the MLP at 1080p (floor, before, each fused kernel's default) and Qwen3
    1080p attention (FA4 and the tiles that fix its wave tail), 2. the other configs and layouts, the fc1s,
    the norm, 3. the 8 x 448 shape (timing only: the kernels are compiled by then) and torch.compile,
    4. inductor's max-autotune."""
    if not sweep:
        return list(NEW)
    from encoder_service.ops import swiglu_gemm_triton as T

    triton = [f"triton_fused[{c.name}]" for c in T.CONFIGS]
    quack = [f"quack[{name}]" for name in QUACK_CONFIGS]
    mlp = ["cublas_gemm_only", "split", *triton, *quack]
    first = ["mlp/q25_1080p/" + v for v in ("cublas_gemm_only", "split", triton[0], quack[0])]
    first += ["attn/q3_1080p/" + c for c in ("fa4", tile_name((128, 128, True, True)),
                                             tile_name((128, 128, False, True)), "fa4_dense")]
    second = [f"mlp/q25_1080p/{v}" for v in mlp]
    for name, lay in attention_layouts().items():
        one = len(lay["cu"]) == 2
        cands = ["fa4"] + [tile_name(t) for t in (FA4_TILES if lay["D"] == 72 else FA4_TILES_D80)]
        cands += (["fa4_dense", "cudnn_dense"] if one else []) + (["fa4_pad80"] if lay["D"] == 72 else [])
        second += [f"attn/{name}/{c}" for c in cands]
    second += ["fc1/q3_1080p/cublaslt_gelu", "fc1/q3_1080p/quack_gelu", *NEW, "norm/q25_1080p/ours_triton",
               "norm/q25_1080p/quack_rmsnorm"]
    third = [f"mlp/q25_8x448/{v}" for v in mlp] + ["mlp/q25_1080p/inductor", "mlp/q25_8x448/inductor"]
    fourth = ["mlp/q25_1080p/inductor_max_autotune"]
    return list(dict.fromkeys(first + second + third + fourth))


def flops(item: str) -> float:
    group, shape, _ = item.split("/")
    if group == "mlp":
        return 2.0 * MLP_SHAPES[shape] * E25 * 2 * I25
    if group == "fc1":
        return 2.0 * M2 * E2 * I2 if shape == "q2_1080p" else 2.0 * 8160 * E3 * I3
    if group == "attn":
        lay = attention_layouts()[shape]
        lengths = [b - a for a, b in zip(lay["cu"], lay["cu"][1:])]
        return 4.0 * sum(x * x for x in lengths) * lay["D"] * HEADS
    return 0.0


def moved_bytes(item: str) -> float:
    """Bytes a norm item must move (read x, write its outputs), for its GB/s."""
    return 10764 * E25 * 2 * (3 if item.endswith("ours_triton") else 2)


# ---- inputs ---------------------------------------------------------------------------------------------


class Inputs:
    """Static device buffers of one shape and two input sets with their float32 references."""

    def __init__(self, tensors: dict[str, torch.Tensor], sets: list[dict], refs: list[torch.Tensor]):
        self.t, self._sets, self.refs = tensors, sets, refs

    def load(self, i: int) -> None:
        for name, value in self._sets[i].items():
            self.t[name].copy_(value)


def _randn(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


@functools.lru_cache(maxsize=4)
def mlp_inputs(rows: int, gemm_only: bool) -> Inputs:
    """x [rows, 1280] (two sets), weight [6912, 1280] ~ N(0, 1/1280), bias [6912] ~ N(0, 0.25)."""
    from encoder_service.ops.mlp_kernels import FORMS

    gen = torch.Generator(device="cuda").manual_seed(rows)
    w, b = _randn(gen, 2 * I25, E25, scale=E25**-0.5), _randn(gen, 2 * I25, scale=0.5)
    sets = [dict(x=_randn(gen, rows, E25)) for _ in range(2)]
    if gemm_only:
        refs = [F.linear(s["x"].float(), w.float(), b.float()) for s in sets]
    else:
        refs = [FORMS["swiglu"].reference(s["x"], w, b) for s in sets]
    return Inputs(dict(x=torch.empty_like(sets[0]["x"]), w=w, b=b), sets, refs)


def fc1_inputs(shape: str) -> Inputs:
    """Qwen3's fc1 + tanh GELU (q3_1080p) or Qwen2's fc1 + quick_gelu (q2_1080p): x (two sets), w, b."""
    from encoder_service.ops.mlp_kernels import FORMS

    rows, e, i, form = (M2, E2, I2, "quick_gelu") if shape == "q2_1080p" else (8160, E3, I3, "gelu_tanh")
    gen = torch.Generator(device="cuda").manual_seed(3)
    w, b = _randn(gen, i, e, scale=e**-0.5), _randn(gen, i, scale=0.5)
    sets = [dict(x=_randn(gen, rows, e)) for _ in range(2)]
    refs = [FORMS[form].reference(s["x"], w, b) for s in sets]
    return Inputs(dict(x=torch.empty_like(sets[0]["x"]), w=w, b=b), sets, refs)


def norm_inputs() -> Inputs:
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = (1 + _randn(gen, E25, scale=0.1).float()).to(torch.bfloat16)
    sets = [dict(x=_randn(gen, 10764, E25, scale=3.0)) for _ in range(2)]

    def ref(x):
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()

    return Inputs(dict(x=torch.empty_like(sets[0]["x"]), w=w, pb=_randn(gen, E25)), sets, [ref(s["x"]) for s in sets])


def attn_inputs(lay: dict) -> Inputs:
    from encoder_service.ops.attention import reference_attention

    n, d = lay["cu"][-1], lay["D"]
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    sets = []
    for _ in range(2):
        qkv = torch.empty(n, 3, HEADS, d, dtype=torch.bfloat16, device="cuda")
        qkv[:, :2].normal_(0.0, 1.5, generator=gen)  # scores with std ~2.25: not a flat softmax
        qkv[:, 2].normal_(0.0, 1.0, generator=gen)
        sets.append(dict(qkv=qkv))
    cu = torch.tensor(lay["cu"], dtype=torch.int32, device="cuda")
    refs = [reference_attention(s["qkv"][:, 0], s["qkv"][:, 1], s["qkv"][:, 2], cu) for s in sets]
    t = dict(qkv=torch.empty_like(sets[0]["qkv"]), cu=cu)
    return Inputs(t, sets, refs)


# ---- candidates -----------------------------------------------------------------------------------------


def attention_call(cand: str, d: int):
    """run(q, k, v, cu, max_seqlen) -> [N, H, d] for an attention candidate name."""
    from encoder_service.ops import attention_fa4
    from encoder_service.ops.attention_torch import dense_sdpa

    if cand == "fa4":
        return attention_fa4.fa4_attention
    if cand.startswith("fa4_tiles["):
        from flash_attn.cute.interface import _flash_attn_fwd

        m, n, rs, ol = parse_tile(cand)

        def tiled(q, k, v, cu, max_seqlen):
            return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=int(max_seqlen),
                                   max_seqlen_k=int(max_seqlen), causal=False, tile_mn=(m, n), mma_pv_is_rs=rs,
                                   intra_wg_overlap=ol)[0]

        return tiled
    if cand == "fa4_dense":
        from flash_attn.cute import flash_attn_func

        def dense(q, k, v, cu, max_seqlen):
            out = flash_attn_func(q[None], k[None], v[None], causal=False)
            return (out[0] if isinstance(out, (tuple, list)) else out)[0]

        return dense
    if cand == "fa4_pad80":
        def padded(q, k, v, cu, max_seqlen):
            from flash_attn.cute import flash_attn_varlen_func

            qp, kp, vp = (F.pad(t, (0, 80 - d)) for t in (q, k, v))
            out = flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=int(max_seqlen),
                                         max_seqlen_k=int(max_seqlen), causal=False, softmax_scale=d**-0.5)
            out = out[0] if isinstance(out, (tuple, list)) else out
            return out[..., :d].contiguous()

        return padded
    if cand == "cudnn_dense":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q, k, v, cu, max_seqlen):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return dense_sdpa(q, k, v)

        return cudnn
    raise ValueError(cand)


def run_item(item: str) -> dict:
    """One item's record: numerics (eager and graph) and ms, or why it could not run."""
    from encoder_service.ops import attention_fa4, mlp_kernels, norm, quack_gemm, swiglu_gemm_triton

    group, shape, cand = item.split("/")
    base = cand.split("[")[0]
    dev = torch.device("cuda")
    if "quack" in base:
        ok, why = quack_gemm.available(dev)
        if not ok:
            return dict(status="unavailable", why=why)
    if group == "attn" and base != "cudnn_dense":
        ok, why = attention_fa4.available(dev)
        if not ok:
            return dict(status="unavailable", why=why)

    if group == "mlp":
        inp = mlp_inputs(MLP_SHAPES[shape], base == "cublas_gemm_only")
        x, w, b = inp.t["x"], inp.t["w"], inp.t["b"]
        if base == "cublas_gemm_only":
            call = functools.partial(F.linear, x, w, b)
        elif base == "split":
            call = functools.partial(mlp_kernels.FORMS["swiglu"].backend("split").run, x, w, b, None)
        elif base == "triton_fused":
            cfg = next(c for c in swiglu_gemm_triton.CONFIGS if c.name == cand[len("triton_fused["):-1])
            call = functools.partial(swiglu_gemm_triton.swiglu_gemm_triton, x, w, b, config=cfg)
        elif base == "quack":
            call = functools.partial(quack_gemm.gemm_act_quack, x, w, b, "swiglu",
                                     fields=QUACK_CONFIGS[cand[len("quack["):-1]])
        else:  # inductor
            mode = "max-autotune-no-cudagraphs" if base == "inductor_max_autotune" else "default"
            fn = torch.compile(_reference_gated, mode=mode, dynamic=False)
            call = functools.partial(fn, x, w, b)
    elif group == "fc1":
        inp = fc1_inputs(shape)
        x, w, b = inp.t["x"], inp.t["w"], inp.t["b"]
        form = mlp_kernels.FORMS["quick_gelu" if shape == "q2_1080p" else "gelu_tanh"]
        backend = {"cublaslt_gelu": "cublaslt", "torch_quick_gelu": "torch"}.get(cand, "quack")
        call = functools.partial(form.backend(backend).run, x, w, b, None)  # quack: quack's default tile
    elif group == "norm":
        inp = norm_inputs()
        x, w, pb = inp.t["x"], inp.t["w"], inp.t["pb"]
        if cand == "ours_triton":
            call = lambda: norm.norm_residual_triton(x, w, None, 1e-6, True, pb)[0]  # noqa: E731
        else:
            from quack.rmsnorm import rmsnorm

            call = functools.partial(rmsnorm, x, w, eps=1e-6)
    else:  # attn
        lay = attention_layouts()[shape]
        inp = attn_inputs(lay)
        qkv, cu, d = inp.t["qkv"], inp.t["cu"], lay["D"]
        q, k, v = torch.empty_like(qkv[:, 0]), torch.empty_like(qkv[:, 1]), qkv[:, 2]
        loader = inp.load

        def load(i):  # q and k contiguous (the rotary writes them), v the strided view
            loader(i)
            q.copy_(qkv[:, 0])
            k.copy_(qkv[:, 1])

        inp.load = load
        run = attention_call(cand, d)
        call = functools.partial(run, q, k, v, cu, lay["max_seqlen"])
    rec = bench_call(call, inp.load, inp.refs)
    rec["status"] = "ok" if rec["ok"] else "wrong"
    return rec


def _reference_gated(x, w, b):
    i = w.shape[0] // 2
    return F.silu(F.linear(x, w[:i], b[:i])) * F.linear(x, w[i:], b[i:])
