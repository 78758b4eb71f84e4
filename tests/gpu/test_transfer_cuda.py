"""runtime/transfer.py on the GPU: pinned staging on a side stream, copied in pieces, owned pageable rows out (from
the copier's HostRowPool: memory of rows dropped before is reused, never that of rows still referenced; by
default mappings are faulted in ahead)."""

from __future__ import annotations

import torch

from encoder_service.rowpath.host_pool import HostRowPool
from encoder_service.runtime.transfer import PIECE_BYTES, HostCopier
from tests.support.waits import wait_for


def test_cuda_outputs_arrive_owned_and_exact():
    copier = HostCopier()
    try:
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
    finally:
        copier.pool.close()  # (its prefault thread ends)


def test_rows_land_in_the_pool_and_reuse_memory_once_dropped():
    copier = HostCopier(HostRowPool())  # nothing made ahead: every take below is counted as the test says
    g = torch.Generator(device="cuda").manual_seed(0)
    outs = [torch.randn(880, 16384, device="cuda", generator=g).bfloat16() for _ in range(2)]  # Qwen3 720p rows
    first = copier.start(outs).wait()
    addresses = {r.data_ptr() for r in first}
    assert copier.pool.stats()["fresh"] == 2 and all(torch.equal(r, o.cpu()) for r, o in zip(first, outs))
    kept = first[0][:10]  # a view keeps its image's memory out of the pool
    del first
    outs = [o.flip(0) for o in outs]
    second = copier.start(outs).wait()
    stats = copier.pool.stats()
    assert stats["reused"] == 1 and stats["fresh"] == 3
    assert {r.data_ptr() for r in second} & addresses == addresses - {kept.data_ptr()}
    assert all(torch.equal(r, o.cpu()) for r, o in zip(second, outs)) and not kept.is_pinned()


def test_the_default_copier_lands_rows_in_mappings_made_ahead():
    """Rows kept (a cache filling up gives nothing back): after the first image, the next ones' rows land in
    mappings the pool's thread faulted in ahead, and arrive exact though copied in several pieces each."""
    copier = HostCopier()
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        kept = []
        for k in range(4):
            outs = [torch.randn(2040, 16384, device="cuda", generator=g).bfloat16()]  # Qwen3 1080p: 66.8 MB
            assert outs[0].numel() * 2 > 4 * PIECE_BYTES
            kept += copier.start(outs).wait()
            assert torch.equal(kept[-1], outs[0].cpu())
            if k == 0:  # (up to four fit in the 256 MiB kept ahead; three are enough for the next three)
                wait_for(lambda: copier.pool.stats()["idle_bytes"] >= 3 * outs[0].numel() * 2, "three ahead", 10)
        stats = copier.pool.stats()
        assert stats["fresh"] == 1 and stats["reused"] == 3, stats
    finally:
        copier.pool.close()
