"""The CuTe DSL packages' one import (ops/cutlass_dsl.py: DslImport), without the DSL: tried once on first
use, its failure kept as the reason, never tried for a device that cannot run it."""

from __future__ import annotations

import pytest
import torch

from encoder_service.ops.cutlass_dsl import DslImport


def test_an_import_is_tried_once_and_its_failure_kept():
    tries = []

    def load():
        tries.append(1)
        raise ImportError("no flash_attn " * 40)

    pkg = DslImport("flash_attn.cute", load, majors=(9, 10), arch_note="sm90 / sm100 only", reason_chars=40)
    assert tries == []  # nothing at construction
    fn, why = pkg.get()
    assert fn is None and why == "import flash_attn.cute failed: ImportError: " + ("no flash_attn " * 40)[:40]
    assert pkg.get() == (None, why) and tries == [1]
    with pytest.raises(RuntimeError, match="import flash_attn.cute failed: ImportError"):
        pkg.require()
    ok = DslImport("m", lambda: ("entry", "points"), majors=(9,), arch_note="")
    assert ok.get() == (("entry", "points"), "") and ok.require() == ("entry", "points")


def test_a_device_that_cannot_run_it_never_imports():
    def load():
        raise AssertionError("imported for a CPU device")

    pkg = DslImport("quack.gemm_interface", load, majors=(9,), arch_note="sm90 only")
    assert pkg.available(torch.device("cpu")) == (False, "needs a CUDA device")
