"""The gated MLP's kernel policy (ops/mlp_kernels.py) on the CPU: the chain per choice, selection with faked
availability and startup checks (no CUDA touched), demotion to the next backend, and the CPU path of the
towers' gated MLP staying the reference (the kernels only run on CUDA in half precision)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encoder_service.ops import activation, mlp_kernels as M

CUDA = torch.device("cuda")  # a device object only: nothing here initialises CUDA
BF16 = torch.bfloat16
ALL = {name: True for name in M.BACKENDS}


@pytest.fixture
def checks(monkeypatch):
    """Fake startup checks: backend name -> '' (passes) or why it fails; records which ran."""
    verdicts, ran = {}, []

    def fake_check(run, device, dtype, e, i):
        name = next(n for n, b in M.BACKENDS.items() if b.run is run)
        ran.append(name)
        return verdicts.get(name, "")

    monkeypatch.setattr(M, "check_backend", fake_check)
    return verdicts, ran


def test_chains_end_in_split_and_put_a_forced_choice_first():
    assert M.chain("auto")[-1] == M.FALLBACK == "split"
    assert M.chain("auto") == tuple(dict.fromkeys(M.TABLE + ("split",)))
    assert M.chain("quack")[0] == "quack" and M.chain("triton_fused")[0] == "triton_fused"
    assert M.chain("split") == ("split",)
    with pytest.raises(ValueError, match="MLP kernel choice"):
        M.chain("cutlass")


def test_auto_runs_no_check_while_its_table_is_split_only(checks, monkeypatch):
    monkeypatch.setattr(M, "TABLE", ("split",))
    _, ran = checks
    assert M.GatedKernelPolicy("auto", available=ALL).select(CUDA, BF16, 1280, 3456) == "split"
    assert ran == []


def test_a_forced_backend_runs_after_its_check_once_per_key(checks):
    _, ran = checks
    policy = M.GatedKernelPolicy("quack", available=ALL)
    assert policy.select(CUDA, BF16, 1280, 3456) == "quack"
    assert policy.select(CUDA, BF16, 1280, 3456) == "quack"
    assert ran == ["quack"]
    assert policy.select(CUDA, BF16, 64, 96) == "quack" and ran == ["quack", "quack"]  # another width: checked
    assert policy.describe()["selected"] == {"cuda/E1280/I3456/bfloat16": "quack", "cuda/E64/I96/bfloat16": "quack"}


def test_a_failed_check_or_a_missing_backend_demotes_to_the_next(checks, monkeypatch):
    verdicts, ran = checks
    monkeypatch.setattr(M, "TABLE", ("quack", "triton_fused", "split"))
    verdicts["quack"] = "relative error 5e-01 > 0.01 against float32"
    policy = M.GatedKernelPolicy("auto", available=ALL)
    assert policy.select(CUDA, BF16, 1280, 3456) == "triton_fused"
    assert ran == ["quack", "triton_fused"]
    assert policy.describe()["demoted"] == {"quack@cuda/E1280/I3456/bfloat16": verdicts["quack"]}
    absent = M.GatedKernelPolicy("auto", available={**ALL, "quack": "quack-kernels not installed",
                                                    "triton_fused": "needs TMA (sm90+)"})
    assert absent.select(CUDA, BF16, 1280, 3456) == "split"
    assert ran == ["quack", "triton_fused"]  # a backend that is not here is never checked
    assert set(absent.describe()["demoted"].values()) == {"quack-kernels not installed", "needs TMA (sm90+)"}


def test_use_policy_is_per_thread_and_restored():
    policy = M.GatedKernelPolicy("split")
    default = M.active_policy()
    with M.use_policy(policy):
        assert M.active_policy() is policy
    assert M.active_policy() is default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_gated_mlp_is_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((37, 64), (2 * 48, 64), (2 * 48,)))
    with M.use_policy(M.GatedKernelPolicy("quack")):  # no kernel runs off CUDA, whatever the policy
        out = activation.gated_linear_act(x, w, b, F.silu)
    assert torch.equal(out, F.silu(F.linear(x, w[:48], b[:48])) * F.linear(x, w[48:], b[48:]))
