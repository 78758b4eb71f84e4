"""The attention selection table and its fallbacks (ops/attention.py), on the CPU: layout classes from the
graphs' real padded layouts, the chain per choice with fake availability (no FA4, no Triton, no CUDA
touched), head-dim limits, demotion by the startup check and by a backend that raises,
the torch backends against the float32 reference, and the --attention setting reaching the runners."""

from __future__ import annotations

import sys

import pytest
import torch

from encoder_service.models.metadata import EXACT, MULTI, SINGLE, PaddedShape, build_batch_metadata
from encoder_service.ops import attention as A
from encoder_service.ops import attention_fa4
from encoder_service.runtime.eager import EagerRunner
from encoder_service.runtime.graphs import GraphRunner
from encoder_service.runtime.runner import make_runner
from encoder_service.settings import ATTENTION, Settings, SettingsError

BF16 = torch.bfloat16
CUDA = torch.device("cuda")  # a device object only: nothing here initialises CUDA
EVERYTHING = {"fa4": True, "triton": True, "varlen_attn": True, "torch": True}


def policy(choice="auto", **missing) -> A.AttentionPolicy:
    """A policy whose availability is faked: EVERYTHING present except `missing` (name=reason)."""
    return A.AttentionPolicy(choice, available={**EVERYTHING, **missing})


def pick(p: A.AttentionPolicy, cls: str, head_dim: int = 80, segments: int | None = None) -> str:
    n, slots, max_seqlen = {A.ONE: (8160, 1, 8160), A.PADDED_SINGLE: (4096, 2, 4096),
                            A.SEVERAL: (8192, 33, 8192), A.WINDOWS: (10764, 993, 64)}[cls]
    return p.select(n, segments or slots, max_seqlen, head_dim, BF16, CUDA)


def graph_layout(grid, kind, *, bucket, window_units=None):
    """(N, slots, max_seqlen) of the full-attention (or, with window_units, the window) layers of one
    image padded into a graph of `kind`, by the graphs' own padding rule."""
    meta = build_batch_metadata([grid], merge=2, head_dim=80, rope_theta=10000.0, window_units=window_units)
    padded = meta.padded(PaddedShape.for_graph(bucket, kind, max_images=32, merge_unit=4, window_units=window_units))
    if window_units:
        return padded.num_patches, padded.cu_window_seqlens.numel() - 1, padded.max_window_seqlen
    return padded.num_patches, padded.cu_seqlens.numel() - 1, padded.max_seqlen


def test_layout_classes_of_the_graph_layouts():
    assert A.layout_class(*graph_layout((1, 68, 120), EXACT, bucket=8160)) == A.ONE  # 1080p, exact bucket
    assert A.layout_class(*graph_layout((1, 46, 62), SINGLE, bucket=4096)) == A.PADDED_SINGLE
    assert A.layout_class(*graph_layout((1, 64, 64), SINGLE, bucket=4096)) == A.PADDED_SINGLE  # fits exactly
    assert A.layout_class(*graph_layout((1, 28, 28), MULTI, bucket=8192)) == A.SEVERAL
    assert A.layout_class(*graph_layout((1, 78, 138), EXACT, bucket=10764, window_units=4)) == A.WINDOWS
    assert A.layout_class(*graph_layout((1, 28, 28), MULTI, bucket=8192, window_units=4)) == A.WINDOWS
    assert A.layout_class(16, 1, 16) == A.ONE  # a tiny image alone: dense, not windows
    assert A.layout_class(6272, 8, 784) == A.SEVERAL  # eager batch of 8 images
    assert A.layout_class(1568, 2, 784) == A.SEVERAL  # two images eagerly: 2 slots but max_seqlen < N
    assert A.layout_class(3 * 64, 3, 64) == A.WINDOWS  # tiny frames: any <= 64-row segments


def test_auto_table_with_everything_present():
    p = policy()
    assert [pick(p, c) for c in A.LAYOUTS] == ["fa4", "fa4", "fa4", "triton_short"]
    assert pick(p, A.ONE, head_dim=72) == "fa4"


def test_auto_without_fa4_is_the_torch_dispatch_of_before():
    p = policy(fa4="not installed")
    assert [pick(p, c) for c in A.LAYOUTS] == ["torch_dense", "torch_two_segment", "torch_varlen", "triton_short"]
    p = policy(fa4="no", triton="no")
    assert pick(p, A.WINDOWS) == "torch_varlen"
    p = policy(fa4="no", triton="no", varlen_attn="torch < 2.10")
    assert pick(p, A.SEVERAL) == pick(p, A.WINDOWS) == "torch_masked"  # the last resort
    assert p.describe()["missing"] == {"fa4": "no", "triton": "no", "varlen_attn": "torch < 2.10"}


def test_forced_choices_and_their_fallbacks():
    assert [pick(policy("fa4"), c) for c in A.LAYOUTS] == ["fa4"] * 4
    assert [pick(policy("fa4", fa4="x"), c) for c in A.LAYOUTS] == [
        "torch_dense", "torch_two_segment", "torch_varlen", "triton_short"]
    assert [pick(policy("torch"), c) for c in A.LAYOUTS] == [
        "torch_dense", "torch_two_segment", "torch_varlen", "torch_varlen"]  # no FA4, no Triton attention
    for choice in A.CHOICES:
        for cls in A.LAYOUTS:
            names = A.chain(choice, cls)
            assert names[-1] == A.LAST_RESORT and len(set(names)) == len(names)
            assert any(cls in A.BACKENDS[n].layouts for n in names[:-1])  # a real kernel before the last resort
    for gone in ("cudnn", "triton"):  # triton: the split kernel's choice, out of the service
        with pytest.raises(ValueError, match="one of auto, fa4, torch"):
            A.AttentionPolicy(gone)


def test_head_dim_limits():
    p = policy()
    assert pick(p, A.ONE, head_dim=36) == "torch_dense"  # FA4 needs a multiple of 8
    assert pick(p, A.ONE, head_dim=136) == "torch_dense"  # and at most 128 (sm90 and sm100 alike)
    assert pick(p, A.WINDOWS, head_dim=136) == "torch_varlen"  # the one-tile kernel pads D to 256 above 128
    assert pick(p, A.ONE, head_dim=8) == "fa4"
    assert pick(p, A.SEVERAL, segments=4000) == "fa4"  # any number of segment slots


def test_demotion_moves_one_layout_class_down_its_chain():
    p = policy()
    assert pick(p, A.ONE) == "fa4"
    p.demote("fa4", (A.ONE, 80, BF16), "wrong numbers")
    assert pick(p, A.ONE) == "torch_dense" and pick(p, A.SEVERAL) == "fa4" and pick(p, A.ONE, head_dim=72) == "fa4"
    assert p.describe()["demoted"] == {"fa4@one/D80": "wrong numbers"}
    assert "fa4@one/D80 demoted (wrong numbers)" in p.summary()
    with pytest.raises(RuntimeError, match="torch_masked failed"):
        p.demote(A.LAST_RESORT, (A.ONE, 80, BF16), "x")


def _qkv(n, heads=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, 3, heads, d, generator=g).to(dtype)
    return qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]


def test_a_backend_that_raises_is_demoted_and_the_call_falls_back(monkeypatch):
    calls = []

    def broken(q, k, v, cu, max_seqlen):
        calls.append(1)
        raise RuntimeError("JIT failed")

    monkeypatch.setitem(A.BACKENDS, "fa4", A.Backend("fa4", broken, frozenset(A.LAYOUTS), "fa4"))
    p = policy()
    q, k, v = _qkv(40, dtype=BF16)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    out = p.attention(q, k, v, cu, 40)  # fa4 raises: demoted, torch_dense (CPU SDPA) answers
    ref = A.reference_attention(q, k, v, cu)
    assert calls == [1] and (out.float() - ref).abs().max() < 2e-2
    assert p.selected()["one/D16/bfloat16"] == "torch_dense"
    p.attention(q, k, v, cu, 40)
    assert calls == [1]  # not tried again
    q32, k32, v32 = _qkv(40)
    ref32 = A.reference_attention(q32, k32, v32, cu)
    assert torch.allclose(p.attention(q32, k32, v32, cu, 40), ref32, atol=1e-5)  # float32: the masked reference


def test_startup_check_demotes_a_wrong_backend(monkeypatch):
    seen = []

    def fake_check(run, case, num_heads, head_dim, dtype, device, capture):
        name = next(n for n, b in A.BACKENDS.items() if b.run is run)
        seen.append((name, case.slots, capture))
        return "relative error 1.0" if name == "fa4" else None

    monkeypatch.setattr(A, "check_backend", fake_check)
    p = policy()
    p.check(head_dim=80, num_heads=16, dtype=BF16, device=CUDA, layouts=(A.ONE, A.WINDOWS), capture=True)
    assert pick(p, A.ONE) == "torch_dense" and pick(p, A.WINDOWS) == "triton_short"
    assert pick(p, A.SEVERAL) == "fa4"  # not checked: not demoted
    assert ("fa4", 1, True) in seen and ("torch_dense", 1, True) in seen
    assert {s for n, s, _ in seen if n == "triton_short"} == {c.slots for c in A.CHECK_CASES[A.WINDOWS]}
    count = len(seen)
    p.check(head_dim=80, num_heads=16, dtype=BF16, device=CUDA, layouts=(A.ONE, A.WINDOWS), capture=True)
    assert len(seen) == count  # each (backend, case) is checked once
    A.AttentionPolicy().check(head_dim=80, num_heads=16, dtype=BF16, device="cpu")  # a no-op off CUDA
    A.AttentionPolicy().check(head_dim=80, num_heads=16, dtype=torch.float32, device=CUDA)  # and in float32
    assert len(seen) == count


def test_check_backend_catches_wrong_nan_and_raising_backends():
    case = A.CheckCase((30, 0, 17), 4, 30)
    ok = A.BACKENDS["torch_masked"].run
    assert A.check_backend(ok, case, 2, 16, torch.float32, "cpu", False) is None
    assert A.check_backend(ok, case, 2, 16, BF16, "cpu", False) is None
    zeros = lambda q, k, v, cu, m: torch.zeros_like(q)  # noqa: E731
    assert "relative error" in A.check_backend(zeros, case, 2, 16, BF16, "cpu", False)

    def nan_rows(q, k, v, cu, m):
        out = A.reference_attention(q, k, v, cu).to(q.dtype)
        out[3] = float("nan")
        return out

    assert A.check_backend(nan_rows, case, 2, 16, BF16, "cpu", False) == "1 rows with NaN"

    def raises(q, k, v, cu, m):
        raise ValueError("no kernel for this")

    assert A.check_backend(raises, case, 2, 16, BF16, "cpu", False) == "ValueError: no kernel for this"


@pytest.mark.parametrize("name", ["torch_dense", "torch_two_segment", "torch_masked"])
def test_torch_backends_pass_the_startup_check_cases_on_cpu(name):
    backend = A.BACKENDS[name]
    for cls in backend.layouts:
        for case in A.CHECK_CASES[cls]:
            if case.bounds[-1] <= 1100:  # the masked path is O(N^2)
                assert A.check_backend(backend.run, case, 2, 72, BF16, "cpu", False) is None, (cls, case)


def test_check_cases_are_of_their_class():
    for cls, cases in A.CHECK_CASES.items():
        for case in cases:
            bounds = case.bounds
            assert len(bounds) == case.slots + 1 and bounds[0] == 0
            assert max(b - a for a, b in zip(bounds, bounds[1:])) <= case.max_seqlen
            assert A.layout_class(bounds[-1], case.slots, case.max_seqlen) == cls
    assert max(c.slots for c in A.CHECK_CASES[A.WINDOWS]) > 256  # FA4's many-segment scheduler variant


def test_cpu_never_touches_the_policy_or_fa4(monkeypatch):
    def boom():
        raise AssertionError("the CPU path must not ask for a policy")

    monkeypatch.setattr(A, "active_policy", boom)
    q, k, v = _qkv(20)
    cu = torch.tensor([0, 5, 20, 20], dtype=torch.int32)
    assert torch.equal(A.varlen_attention(q, k, v, cu, 15), A.reference_attention(q, k, v, cu))
    assert attention_fa4.available(torch.device("cpu"))[0] is False
    assert "flash_attn" not in sys.modules and "cutlass" not in sys.modules


def test_use_policy_is_scoped():
    default = A.active_policy()
    mine = A.AttentionPolicy("torch")
    with A.use_policy(mine):
        assert A.active_policy() is mine
        with A.use_policy(A.AttentionPolicy("fa4")):
            assert A.active_policy().choice == "fa4"
        assert A.active_policy() is mine
    assert A.active_policy() is default and default.choice == "auto"


def test_the_setting_reaches_the_runners(tiny_checkpoint):
    assert ATTENTION == A.CHOICES
    assert Settings.from_args(["--model", "m"], env={}).engine.attention == "auto"
    assert Settings.from_args(["--model", "m"], env={"ENCODER_ATTENTION": "torch"}).engine.attention == "torch"
    assert Settings.from_args(["--model", "m", "--attention", "FA4"], env={"ENCODER_ATTENTION": "torch"}
                              ).engine.attention == "fa4"
    for gone in ("cudnn", "triton"):
        with pytest.raises(SettingsError, match="--attention / ENCODER_ATTENTION"):
            Settings.from_args(["--model", "m", "--attention", gone], env={})
    from encoder_service.models.loader import load_model

    lm = load_model(tiny_checkpoint("qwen2_5_vl"), device="cpu", dtype=torch.float32)
    eager = make_runner(lm, cuda_graphs=False, attention="fa4")
    assert isinstance(eager, EagerRunner) and eager.describe()["attention"]["choice"] == "fa4"
    graphs = GraphRunner(lm, buckets=[64], capture=False, attention="torch")
    assert graphs.attention is graphs.eager.attention and graphs.describe()["attention"]["choice"] == "torch"
