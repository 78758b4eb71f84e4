"""runtime/transfer.py: the engine's device-to-host copy of a batch's outputs."""

from __future__ import annotations

import torch

from encoder_service.runtime.transfer import HostCopier


def test_cpu_outputs_pass_through():
    outs = [torch.randn(3, 4), torch.randn(5, 4)]
    rows = HostCopier().start(outs).wait()
    assert [r.data_ptr() for r in rows] == [o.data_ptr() for o in outs]  # already owned host tensors
