"""Each fused kernel of ops/ against its torch reference on the same CUDA bfloat16 inputs (the CPU tiers
run only the references). Differences are rounding only: the kernels keep float32 inside and round once.
The MLPs: every kernel of ops/mlp_kernels.py this machine has, per form (SiLU-gated: split, our fused Triton
GEMM per tile config, quack; tanh GELU: cuBLASLt, quack; quick_gelu: torch, quack; quack when installed)
against float32, eagerly and replayed in a captured graph, and every choice through the towers' ops.
Attention: every backend this machine has (FA4 when installed, our Triton window kernel, torch's) against
float32 attention on the towers' real layouts (head dims 72 and 80, padded by the graphs' own rule: dummy
segments, zero-length filler slots; v the strided view of a fused qkv), eagerly and replayed in a captured
graph; every --attention choice through its startup check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encoder_service.models.metadata import EXACT, MULTI, SINGLE, PaddedShape, build_batch_metadata
from encoder_service.ops import activation, attention, mlp_kernels, norm, pos_embed, rotary, swiglu_gemm_triton
from encoder_service.ops.fast_path import fast_path

DEV, DT = "cuda", torch.bfloat16


def rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def test_fast_path_only_in_half_precision_on_cuda():
    assert fast_path(torch.ones(1, device=DEV, dtype=DT))
    assert not fast_path(torch.ones(1, device=DEV)) and not fast_path(torch.ones(1, dtype=DT))


@pytest.mark.parametrize("rms", [True, False])
def test_norm_residual(rms):
    x = torch.randn(1000, 1280, device=DEV, dtype=DT)
    w, b, pb = (torch.randn(1280, device=DEV, dtype=DT) for _ in range(3))
    bias = None if rms else b
    normed, residual = norm.pre_norm(x, w, bias, 1e-6, rms=rms, proj_bias=pb)
    ref = norm.rms_norm(x, w, 1e-6) if rms else F.layer_norm(x, (1280,), w, b, 1e-6)
    assert rel(normed, ref) < 1e-2 and rel(residual, x + pb) < 1e-2
    h, wp = torch.randn(1000, 640, device=DEV, dtype=DT), torch.randn(1280, 640, device=DEV, dtype=DT) * 0.05
    assert rel(norm.add_projection(residual, h, wp, pb), x + F.linear(h, wp, pb)) < 1e-2


def test_rotary():
    n, heads, d = 777, 16, 80
    qkv = torch.randn(n, 3 * heads * d, device=DEV, dtype=DT)
    cos, sin = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV)
    q, k, v = rotary.rotate_qkv(qkv, cos, sin, heads)
    view = qkv.view(n, 3, heads, d)
    rq, rk = rotary.apply_rotary(view[:, 0], view[:, 1], cos, sin)
    assert rel(q, rq) < 1e-2 and rel(k, rk) < 1e-2 and torch.equal(v, view[:, 2])


def test_activations():
    x = torch.randn(500, 1280, device=DEV, dtype=DT)
    w, b = torch.randn(2 * 384, 1280, device=DEV, dtype=DT) * 0.03, torch.randn(2 * 384, device=DEV, dtype=DT)
    ref = F.silu(F.linear(x, w[:384], b[:384])) * F.linear(x, w[384:], b[384:])
    assert rel(activation.gated_linear_act(x, w, b, F.silu), ref) < 1e-2
    for act in (activation.gelu_tanh, activation.quick_gelu):
        assert rel(activation.linear_act(x, w, b, act), act(F.linear(x, w, b))) < 1e-2


# ---- the MLPs' kernels ------------------------------------------------------------------------------------

FORM_WIDTHS = {"swiglu": (1280, 3456), "gelu_tanh": (1152, 4352), "quick_gelu": (1280, 5120)}  # padded widths
BACKENDS = [(f.name, b.name) for f in mlp_kernels.FORMS.values() for b in f.backends]


@pytest.mark.parametrize("odd", [False, True], ids=["tower", "odd"])
@pytest.mark.parametrize(("form", "name"), BACKENDS, ids=[f"{f}-{n}" for f, n in BACKENDS])
def test_mlp_backend_against_float32(form, name, odd):
    f = mlp_kernels.FORMS[form]
    e, i = (264, 200) if odd else FORM_WIDTHS[form]
    why = f.backend(name).probe(torch.device(DEV), e, i)
    if why:
        pytest.skip(f"{name}: {why}")
    if name == "quack" and i % 128:  # the towers' widths are padded to 128 (models/configs.py); the startup
        pytest.skip("quack is only asked for multiples of 128")  # check covers any other width it meets
    assert mlp_kernels.check_backend(f, f.backend(name).run, torch.device(DEV), DT, e, i) == ""


@pytest.mark.parametrize("config", swiglu_gemm_triton.CONFIGS, ids=lambda c: c.name)
def test_swiglu_triton_every_tile_config(config):
    x, w, b = torch.randn(333, 264, device=DEV, dtype=DT), torch.randn(400, 264, device=DEV, dtype=DT) * 0.06, \
        torch.randn(400, device=DEV, dtype=DT)
    why = swiglu_gemm_triton.serves(torch.device(DEV), 264, 200)
    if why:
        pytest.skip(why)
    out = torch.full((333, 200), float("nan"), device=DEV, dtype=DT)
    swiglu_gemm_triton.swiglu_gemm_triton(x, w, b, config=config, out=out)
    assert not out.isnan().any() and rel(out, mlp_kernels.FORMS["swiglu"].reference(x, w, b)) < 1e-2


@pytest.mark.parametrize("choice", mlp_kernels.CHOICES)
@pytest.mark.parametrize("form", list(mlp_kernels.FORMS))
def test_every_mlp_choice_through_the_towers_ops(form, choice):
    f = mlp_kernels.FORMS[form]
    e, i = FORM_WIDTHS[form]
    n = 2 * i if f.gated else i
    x, w, b = torch.randn(1000, e, device=DEV, dtype=DT), torch.randn(n, e, device=DEV, dtype=DT) * e**-0.5, \
        torch.randn(n, device=DEV, dtype=DT)
    policy = mlp_kernels.MlpKernelPolicy(choice)
    with mlp_kernels.use_policy(policy):
        out = activation.gated_linear_act(x, w, b, f.act) if f.gated else activation.linear_act(x, w, b, f.act)
    assert rel(out, f.reference(x, w, b)) < 1e-2
    # the first backend of the chain this machine has: a later one means it failed its numerics or capture check
    present = [name for name in f.chain(choice) if not f.backend(name).probe(torch.device(DEV), e, i)]
    assert list(policy.describe()["selected"].values()) == present[:1], policy.describe()


def test_pos_embed():
    n, e = 900, 1152
    x, table = torch.randn(n, e, device=DEV, dtype=DT), torch.randn(2304, e, device=DEV, dtype=DT)
    idx, w = torch.randint(0, 2304, (n, 4), device=DEV), torch.rand(n, 4, device=DEV)
    ref = x + (F.embedding(idx, table) * w[:, :, None]).sum(1).to(DT)
    assert rel(pos_embed.add_position_embedding(x, table, idx, w), ref) < 1e-2


def test_short_segment_attention():
    """Qwen2.5 windows of one 1080p-like image, with graph padding: dummy windows of 64 rows, empty slots."""
    meta = build_batch_metadata([(1, 30, 46)], merge=2, head_dim=80, rope_theta=10000.0, window_units=4)
    bounds = meta.cu_window_seqlens.tolist()
    bounds += list(range(bounds[-1] + 64, 2048, 64)) + [2048] * 5
    cu = torch.tensor(bounds, device=DEV, dtype=torch.int32)
    q, k, v = (torch.randn(2048, 16, 80, device=DEV, dtype=DT) for _ in range(3))
    out = attention.varlen_attention(q, k, v, cu, 64)  # the Triton kernel (max_seqlen <= 64)
    ref = attention.varlen_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), cu.cpu(), 64)
    assert rel(out.cpu(), ref) < 1e-2


# ---- attention backends on the towers' layouts ------------------------------------------------------


def tower_layout(grids, kind=None, bucket=0, windows=False) -> attention.CheckCase:
    """The full-attention (or window) layout of these images, padded into a graph of `kind` and `bucket`
    by models/metadata.py as the graphs pad them (kind None: eager, unpadded), as a CheckCase."""
    meta = build_batch_metadata(grids, merge=2, head_dim=80, rope_theta=10000.0, window_units=4 if windows else None)
    if kind is not None:
        shape = PaddedShape.for_graph(bucket, kind, max_images=32, merge_unit=4, window_units=4 if windows else None)
        meta = meta.padded(shape)
    cu, max_seqlen = (meta.cu_window_seqlens, meta.max_window_seqlen) if windows else (meta.cu_seqlens, meta.max_seqlen)
    bounds = cu.tolist()
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]) if b > a)
    return attention.CheckCase(lengths, len(bounds) - 1, max_seqlen)


LAYOUTS = {
    "one": tower_layout([(1, 32, 48)]),  # an image alone, exact bucket
    "single_padded": tower_layout([(1, 30, 46)], SINGLE, 2048),  # image + dummy segment
    "single_exact_fit": tower_layout([(1, 32, 64)], SINGLE, 2048),  # image + a zero-length slot
    "multi_graph": tower_layout([(1, 16, 16)] * 5 + [(1, 12, 20)], MULTI, 2048),  # + dummy + 26 empty slots
    "several_eager": tower_layout([(1, 16, 16)] * 5 + [(1, 12, 20)]),
    "video_frames": tower_layout([(4, 16, 20)]),  # 4 frames: 4 segments
    "windows_exact": tower_layout([(1, 30, 46)], EXACT, 1380, windows=True),
    "windows_multi_graph": tower_layout([(1, 16, 16)] * 5 + [(1, 12, 20)], MULTI, 2048, windows=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("name", list(attention.BACKENDS))
def test_attention_backend_against_float32(name, head_dim, layout):
    case = LAYOUTS[layout]
    backend = attention.BACKENDS[name]
    cls = attention.layout_class(case.bounds[-1], case.slots, case.max_seqlen)
    if not backend.serves(cls, head_dim):
        pytest.skip(f"{name} does not serve {cls} layouts")
    missing = attention.AttentionPolicy().missing(backend.needs, torch.device(DEV))
    if missing:
        pytest.skip(f"{name}: {missing}")
    assert attention.check_backend(backend.run, case, 16, head_dim, DT, DEV, capture=True) is None


@pytest.mark.parametrize("choice", attention.CHOICES)
def test_every_choice_passes_its_startup_check(choice):
    """Nothing this machine has is demoted: a demotion here is a backend failing numerics or capture."""
    policy = attention.AttentionPolicy(choice)
    for head_dim in (72, 80):
        policy.check(head_dim=head_dim, num_heads=16, dtype=DT, device=DEV, capture=True)
    assert policy.describe()["demoted"] == {}
    selected = set(policy.selected().values())
    if choice == "fa4" and not policy.missing("fa4", torch.device(DEV)):
        assert selected == {"fa4"}
    if choice == "torch":
        assert selected <= {"torch_dense", "torch_two_segment", "torch_varlen"}


def test_varlen_attention_is_the_active_policys():
    case = LAYOUTS["several_eager"]
    q, k, v = (torch.randn(case.bounds[-1], 16, 80, device=DEV, dtype=DT) for _ in range(3))
    cu = torch.tensor(case.bounds, device=DEV, dtype=torch.int32)
    ref = attention.reference_attention(q, k, v, cu)
    for choice in attention.CHOICES:
        policy = attention.AttentionPolicy(choice)
        with attention.use_policy(policy):
            assert rel(attention.varlen_attention(q, k, v, cu, case.max_seqlen), ref) < 1e-2
        assert len(policy.selected()) == 1
