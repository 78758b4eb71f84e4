"""runtime/transfer.py on the GPU: pinned staging on a side stream, owned pageable rows out."""

from __future__ import annotations

import torch

from encoder_service.runtime.transfer import HostCopier


def test_cuda_outputs_arrive_owned_and_exact():
    copier = HostCopier()
    pending = []
    for seed in range(4):  # several batches in flight, their sources freed before the copies are waited on
        g = torch.Generator(device="cuda").manual_seed(seed)
        outs = [torch.randn(n, 3584, device="cuda", generator=g).bfloat16() for n in (1196, 17, 2691)]
        expected = [o.cpu() for o in outs]
        pending.append((copier.start(outs), expected))
        del outs
        torch.randn(64, 2**20, device="cuda")  # reuse freed memory on the compute stream
    for rows, expected in pending:
        got = rows.wait()
        assert all(r.device.type == "cpu" and not r.is_pinned() and r.is_contiguous() for r in got)
        assert all(torch.equal(r, e) for r, e in zip(got, expected))
