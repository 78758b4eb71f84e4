"""The MLP kernel policy (ops/mlp_kernels.py) on the CPU: each form's chain per choice, selection with faked
availability and startup checks (no CUDA touched), demotion to the next backend, and the CPU path of the
towers' MLPs staying the reference (the kernels only run on CUDA in half precision)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encoder_service.ops import activation, mlp_kernels as M

CUDA = torch.device("cuda")  # a device object only: nothing here initialises CUDA
BF16 = torch.bfloat16
ALL = {name: True for name in M.CHOICES if name != "auto"}


@pytest.fixture
def checks(monkeypatch):
    """Fake startup checks: backend name -> '' (passes) or why it fails; records (form, backend) as they run."""
    verdicts, ran = {}, []

    def fake_check(form, run, device, dtype, e, i):
        name = next(b.name for b in form.backends if b.run is run)
        ran.append((form.name, name))
        return verdicts.get(name, "")

    monkeypatch.setattr(M, "check_backend", fake_check)
    return verdicts, ran


def test_auto_walks_the_measured_order_and_every_chain_ends_in_the_fallback():
    swiglu, gelu, quick = M.FORMS["swiglu"], M.FORMS["gelu_tanh"], M.FORMS["quick_gelu"]
    assert swiglu.chain("auto") == ("quack", "triton_fused", "split")
    assert gelu.chain("auto") == ("quack", "cublaslt") and quick.chain("auto") == ("quack", "torch")
    for form in M.FORMS.values():
        for choice in M.CHOICES:
            assert form.chain(choice)[-1] == form.fallback


def test_a_named_choice_goes_first_where_the_form_has_it_else_the_fallback_runs():
    swiglu, gelu = M.FORMS["swiglu"], M.FORMS["gelu_tanh"]
    assert swiglu.chain("triton_fused") == ("triton_fused", "quack", "split")
    assert swiglu.chain("split") == ("split",) and gelu.chain("split") == ("cublaslt",)  # before issue 23
    assert gelu.chain("triton_fused") == ("cublaslt",)
    with pytest.raises(ValueError, match="MLP kernel choice"):
        M.MlpKernelPolicy("cutlass")


def test_auto_takes_the_first_backend_that_passes_once_per_key(checks):
    _, ran = checks
    policy = M.MlpKernelPolicy("auto", available=ALL)
    assert policy.select("swiglu", CUDA, BF16, 1280, 3456) == "quack"
    assert policy.select("swiglu", CUDA, BF16, 1280, 3456) == "quack"
    assert policy.select("gelu_tanh", CUDA, BF16, 1152, 4352) == "quack"
    assert ran == [("swiglu", "quack"), ("gelu_tanh", "quack")]
    assert policy.select("swiglu", CUDA, BF16, 64, 96) == "quack" and len(ran) == 3  # another width: checked
    assert policy.describe()["selected"] == {"swiglu/cuda/E1280/I3456/bfloat16": "quack",
                                             "gelu_tanh/cuda/E1152/I4352/bfloat16": "quack",
                                             "swiglu/cuda/E64/I96/bfloat16": "quack"}


def test_a_failed_check_or_a_missing_backend_demotes_to_the_next(checks):
    verdicts, ran = checks
    verdicts["quack"] = "relative error 5e-01 > 0.01 against float32"
    policy = M.MlpKernelPolicy("auto", available=ALL)
    assert policy.select("swiglu", CUDA, BF16, 1280, 3456) == "triton_fused"
    assert policy.select("gelu_tanh", CUDA, BF16, 1152, 4352) == "cublaslt"  # the fallback: never checked
    assert ran == [("swiglu", "quack"), ("swiglu", "triton_fused"), ("gelu_tanh", "quack")]
    assert policy.describe()["demoted"] == {"quack@swiglu/cuda/E1280/I3456/bfloat16": verdicts["quack"],
                                            "quack@gelu_tanh/cuda/E1152/I4352/bfloat16": verdicts["quack"]}
    ran.clear()
    absent = M.MlpKernelPolicy("auto", available={**ALL, "quack": "quack-kernels not installed",
                                                  "triton_fused": "needs TMA (sm90+)"})
    assert absent.select("swiglu", CUDA, BF16, 1280, 3456) == "split"
    assert absent.select("quick_gelu", CUDA, BF16, 1280, 5120) == "torch"
    assert ran == []  # a backend that is not here is never checked
    assert set(absent.describe()["demoted"].values()) == {"quack-kernels not installed", "needs TMA (sm90+)"}


def test_use_policy_is_per_thread_and_restored():
    policy = M.MlpKernelPolicy("split")
    default = M.active_policy()
    with M.use_policy(policy):
        assert M.active_policy() is policy
    assert M.active_policy() is default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_mlps_are_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((37, 64), (2 * 48, 64), (2 * 48,)))
    with M.use_policy(M.MlpKernelPolicy("quack")):  # no kernel runs off CUDA, whatever the policy
        gated = activation.gated_linear_act(x, w, b, F.silu)
        plain = {act: activation.linear_act(x, w, b, act) for act in (activation.gelu_tanh, activation.quick_gelu)}
    assert torch.equal(gated, F.silu(F.linear(x, w[:48], b[:48])) * F.linear(x, w[48:], b[48:]))
    y = F.linear(x, w, b)
    assert torch.equal(plain[activation.gelu_tanh], F.gelu(y, approximate="tanh"))
    assert torch.equal(plain[activation.quick_gelu], y * torch.sigmoid(1.702 * y))


def test_float32_references():
    gen = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*s, generator=gen).to(BF16) for s in ((9, 32), (2 * 16, 32), (2 * 16,)))
    x32, w32, b32 = x.float(), w.float(), b.float()
    gate, up = x32 @ w32[:16].T + b32[:16], x32 @ w32[16:].T + b32[16:]
    torch.testing.assert_close(M.FORMS["swiglu"].reference(x, w, b), gate * torch.sigmoid(gate) * up)
    y = x32 @ w32.T + b32
    torch.testing.assert_close(M.FORMS["quick_gelu"].reference(x, w, b), y * torch.sigmoid(1.702 * y))
    assert M.FORMS["quick_gelu"].reference(x, w, b).dtype == torch.float32
