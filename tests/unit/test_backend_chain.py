"""The shared backend chain (ops/backend_chain.py) with a made-up op, on the CPU: the chain order per key,
a backend that fails its check demoted with its reason (and only for that key), what is present, the
fallback never checked nor demoted, the float32 check, and the policy in force per thread."""

from __future__ import annotations

import functools
import logging
import threading

import pytest
import torch

from encoder_service.ops import attention, mlp_kernels
from encoder_service.ops.backend_chain import (
    BackendChain,
    ThreadPolicy,
    check_against_float32,
    nan_elements,
    nan_rows,
    relative_error,
)

CPU = torch.device("cpu")


class ToyChain(BackendChain[tuple[str, int]]):
    """Key (size class, width): "small" tries fast, then tiled; "large" only tiled; both end in plain."""

    CHOICES = ("auto", "fast", "tiled")
    kind = "toy"
    log = logging.getLogger("toy_chain")
    ORDER = {"small": ("fast", "tiled", "plain"), "large": ("tiled", "plain")}

    def chain(self, key):
        names = self.ORDER[key[0]]
        if self.choice != "auto" and self.choice in names:
            names = (self.choice, *names)
        return tuple(dict.fromkeys(names))

    def usable(self, name, key, device):
        return name != "tiled" or key[1] % 8 == 0  # tiled needs widths in multiples of 8

    def label(self, key):
        return f"{key[0]}/W{key[1]}"

    def demotion_note(self, name, key):
        return f"toy {name} demoted for {self.label(key)}"


def test_the_chain_order_per_key_and_per_choice():
    toy = ToyChain()
    assert toy.pick(("small", 64), CPU) == "fast" and toy.pick(("large", 64), CPU) == "tiled"
    assert toy.pick(("large", 60), CPU) == "plain"  # tiled does not serve width 60: passed over
    assert ToyChain("tiled").pick(("small", 64), CPU) == "tiled"
    assert toy.selected() == {"large/W60": "plain", "large/W64": "tiled", "small/W64": "fast"}
    with pytest.raises(ValueError, match="toy choice must be one of auto, fast, tiled, got 'slow'"):
        ToyChain("slow")


def test_a_backend_that_fails_its_check_is_demoted_with_its_reason(caplog):
    toy, checked = ToyChain(), []

    def check(name):
        checked.append(name)
        return "relative error 1.0 > 0.01 against float32" if name == "fast" else ""

    with caplog.at_level(logging.WARNING, logger="toy_chain"):
        assert toy.pick_checked(("small", 64), CPU, check) == "tiled"
    assert checked == ["fast", "tiled"]
    assert toy.describe() == {"choice": "auto", "selected": {"small/W64": "tiled"},
                              "demoted": {"fast@small/W64": "relative error 1.0 > 0.01 against float32"}}
    assert caplog.messages == ["toy fast demoted for small/W64: relative error 1.0 > 0.01 against float32"]
    assert toy.pick(("small", 32), CPU) == "fast"  # demoted for that key only
    assert toy.pick_checked(("small", 64), CPU, check) == "tiled" and len(checked) == 2  # once per key
    toy.pick_checked(("small", 64), CPU, check, check_id="in a graph")
    assert checked[2:] == ["tiled"]  # another check id: checked again


def test_the_fallback_runs_unchecked_and_cannot_be_demoted():
    toy = ToyChain()
    assert toy.pick_checked(("large", 64), CPU, lambda name: f"{name} is wrong") == "plain"
    assert toy.demotions() == {"tiled@large/W64": "tiled is wrong"}
    with pytest.raises(RuntimeError, match="plain failed: no kernel"):
        toy.demote("plain", ("large", 64), "no kernel")


def test_a_demotion_drops_the_remembered_pick_of_its_key_only():
    toy = ToyChain()
    assert toy.pick(("small", 64), CPU) == toy.pick(("small", 32), CPU) == "fast"
    toy.demote("fast", ("small", 64), "raised")
    assert toy.picked(("small", 64)) is None and toy.picked(("small", 32)) == "fast"
    assert toy.pick(("small", 64), CPU) == "tiled"


def test_what_is_present_faked_probed_and_remembered():
    toy = ToyChain(available={"gpu": True, "dsl": "not installed", "old": False})
    probes = []

    def probe():
        probes.append(1)
        return "needs sm90"

    assert toy.why_absent("gpu", probe) == "" and toy.why_absent("dsl", probe) == "not installed"
    assert toy.why_absent("old", probe) == "unavailable" and probes == []  # faked: never probed
    assert toy.why_absent("tma", probe) == toy.why_absent("tma", probe) == "needs sm90" and probes == [1]
    assert toy.why_absent("per_shape", probe, remember=False) == "needs sm90" and probes == [1, 1]
    assert toy.absences() == {"dsl": "not installed", "old": "unavailable", "tma": "needs sm90"}


def test_attention_and_the_mlp_kernels_are_one_chain():
    assert issubclass(attention.AttentionPolicy, BackendChain)
    assert issubclass(mlp_kernels.MlpKernelPolicy, BackendChain)


def _inputs(run, n=12, d=4):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen)

    def refill():
        x.copy_(torch.randn(n, d, generator=gen))

    return lambda: (lambda: run(x), lambda: (2 * x).float(), refill)


def test_check_against_float32_on_the_cpu():
    compare = functools.partial(relative_error, rel_tol=1e-2, nans=nan_elements)
    assert check_against_float32(_inputs(lambda x: 2 * x), compare, CPU, capture=False) == ""
    assert check_against_float32(_inputs(lambda x: (2 * x).bfloat16()), compare, CPU, capture=False) == ""
    wrong = check_against_float32(_inputs(lambda x: 3 * x), compare, CPU, capture=False)
    assert wrong == "relative error 5.00e-01 > 0.01 against float32"
    assert check_against_float32(_inputs(lambda x: x[:3]), compare, CPU, capture=False) == "shape (3, 4) != (12, 4)"

    def raises(x):
        raise ValueError("no kernel for this")

    assert check_against_float32(_inputs(raises), compare, CPU, capture=False) == "ValueError: no kernel for this"


def test_nan_counts():
    out = torch.zeros(5, 2, 3)
    out[1, 0, 0] = out[1, 1, 2] = out[4, 0, 1] = float("nan")
    assert nan_rows(out) == "2 rows with NaN" and nan_elements(out) == "3 elements NaN (unwritten or overflowed)"
    assert nan_rows(torch.zeros(5, 2)) == nan_elements(torch.zeros(5, 2)) == ""
    assert relative_error(out, torch.zeros(5, 2, 3), 1e-2, nan_rows) == "2 rows with NaN"


def test_thread_policy_is_per_thread_and_scoped():
    made = []
    policy = ThreadPolicy(lambda: made.append(1) or "default")
    assert made == []  # the default is made on first use
    assert policy.active() == policy.active() == "default" and made == [1]
    with policy.use("runner's"):
        assert policy.active() == "runner's"
        seen = []
        other = threading.Thread(target=lambda: seen.append(policy.active()))
        other.start()
        other.join()
        assert seen == ["default"]  # another thread: not this one's policy
        with policy.use("inner"):
            assert policy.active() == "inner"
        assert policy.active() == "runner's"
    assert policy.active() == "default" and made == [1]
