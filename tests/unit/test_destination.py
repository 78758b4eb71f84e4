"""Where a fetch's rows land on the client (client/destination.py): an `out` that can't take the payload's
bytes in place (on a CUDA device, another dtype, strided) is staged in a host buffer the client reuses. Here
on the CPU, through the same code a CUDA `out` takes (only the buffers' page-locking differs: tests/gpu).
Without `out` the rows are the caller's, on memory of the client's HostRowPool: reused once dropped, never
while the caller holds them."""

from __future__ import annotations

import threading

import pytest
import torch

from encoder_service.client import destination
from encoder_service.client.destination import Destination, StagingBuffers
from encoder_service.protocol.wire import WireHeader
from encoder_service.ranges import Segment
from encoder_service.rowpath.host_pool import PAGE, HostRowPool

WIDTH = 8


@pytest.fixture(autouse=True)
def exact_sizes(monkeypatch):
    """Buffers rounded to 64 bytes, not 4 MiB: payloads of a few rows get buffers of their own sizes."""
    monkeypatch.setattr(destination, "STAGING_ROUND_BYTES", 64)


def fetch(buffers: StagingBuffers, n: int, seed: int) -> None:
    """One staged fetch of `n` bf16 rows (two segments) into a float32 `out` at rows [2, 2 + n)."""
    rows = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    header = WireHeader.of([Segment("a", 2, 0, n // 2), Segment("b", 2 + n // 2, 0, n - n // 2)], rows, "main")
    out = torch.zeros(n + 4, WIDTH)
    with Destination(out, 0, buffers, HostRowPool()) as dest:
        dest.writer(header).write(rows.view(torch.uint8).numpy().tobytes())
        got = dest.finish()
    assert got is out and torch.equal(out[2:2 + n], rows.float()) and not out[:2].any() and not out[2 + n:].any()


def test_fetches_of_changing_sizes_each_get_a_buffer_that_fits():
    """The GPU run's failure: a larger fetch after a smaller one, then a smaller one, then the larger again
    (the idle list holds buffers of two sizes: taking one must not compare it with the others)."""
    buffers = StagingBuffers()
    for k, n in enumerate([3, 40, 40, 3, 40, 200, 3]):
        fetch(buffers, n, seed=k)
    assert [b.numel() for b in buffers.idle()] == [64, 640, 3200]  # one per size, reused


def test_a_buffer_is_reused_and_the_idle_ones_are_bounded():
    buffers = StagingBuffers(max_idle=2, max_idle_bytes=4096)
    a = buffers.take(100, pinned=False)
    assert a.numel() == 128 and a.dtype == torch.uint8 and a.device.type == "cpu"
    buffers.give(a, pinned=False)
    assert buffers.take(100, pinned=False) is a  # the same memory, not a new allocation
    assert buffers.take(100, pinned=False) is not a  # (a is taken)
    big, mid, small = (buffers.take(n, pinned=False) for n in (2000, 1000, 10))
    for b in (big, small, mid):
        buffers.give(b, pinned=False)
    assert [id(b) for b in buffers.idle()] == [id(mid), id(big)]  # two kept: the smallest dropped
    buffers.give(buffers.take(3000, pinned=False), pinned=False)
    assert [b.numel() for b in buffers.idle()] == [3008]  # 1024 + 3008 + 2048 bytes were over 4096
    huge = buffers.take(5000, pinned=False)
    buffers.give(huge, pinned=False)
    assert buffers.idle() == []  # over the byte bound alone: not kept


def test_pinned_and_pageable_buffers_are_never_swapped():
    buffers = StagingBuffers()
    page_locked = torch.empty(4096, dtype=torch.uint8)  # stands for a pinned one (no CUDA here)
    buffers.give(page_locked, pinned=True)
    assert buffers.take(100, pinned=False) is not page_locked
    assert buffers.take(100, pinned=True) is page_locked


def test_overlapping_fetches_never_share_a_buffer():
    """Split streams and threads hold their own buffers at once: disjoint memory, each one's rows right."""
    buffers, dests, spans = StagingBuffers(), [], []
    rows = [torch.full((5, WIDTH), float(k), dtype=torch.bfloat16) for k in range(4)]
    for k in range(4):  # four streams of equal size open at once, as a split fetch's are
        header = WireHeader.of([Segment("a", 0, 0, 5)], rows[k], "main")
        dest = Destination(torch.zeros(5, WIDTH), 0, buffers, HostRowPool())
        dest.writer(header).write(rows[k].view(torch.uint8).numpy().tobytes())
        dests.append(dest)
        staging = dest._staging
        spans.append((staging.data_ptr(), staging.data_ptr() + staging.numel()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for k, dest in enumerate(dests):
        assert torch.equal(dest.finish(), rows[k].float())
        dest.close()
    assert len(buffers.idle()) == 4

    errors = []

    def worker(t: int):
        try:
            for k in range(30):
                fetch(buffers, 2 + (7 * t + 13 * k) % 60, seed=100 * t + k)
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread's rows checked
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(buffers.idle()) <= destination.STAGING_IDLE


def test_an_abandoned_buffer_is_not_reused():
    """A cancelled fetch's reader thread may still write into its buffer: it never goes back to the pool."""
    buffers = StagingBuffers()
    dest = Destination(torch.zeros(4, WIDTH), 0, buffers, HostRowPool())
    dest.writer(WireHeader("bfloat16", WIDTH, "main", (Segment("a", 0, 0, 4),)))
    dest.abandon()
    dest.close()
    assert buffers.idle() == []


def test_an_out_written_in_place_or_no_out_takes_no_buffer():
    buffers = StagingBuffers()
    rows = torch.randn(4, WIDTH)
    header = WireHeader.of([Segment("a", 0, 0, 4)], rows, "main")
    for out in (torch.zeros(4, WIDTH), None):
        with Destination(out, 0, buffers, HostRowPool()) as dest:
            dest.writer(header).write(rows.numpy().tobytes())
            got = dest.finish()
            assert dest._staging is None and torch.equal(got, rows) and (out is None or got is out)
    assert buffers.idle() == []


def test_rows_without_out_are_the_callers_on_pool_memory_reused_once_dropped():
    pool = HostRowPool(min_bytes=PAGE)
    rows = torch.randn(300, WIDTH)  # 9,600 bytes: pooled (over a page)
    header = WireHeader.of([Segment("a", 0, 0, 100), Segment("b", 7, 0, 200)], rows, "main")

    def fetch_rows() -> torch.Tensor:
        with Destination(None, 0, StagingBuffers(), pool) as dest:
            dest.writer(header).write(rows.numpy().tobytes())
            return dest.finish()

    first = fetch_rows()
    address = first.data_ptr()
    assert torch.equal(first, rows) and pool.taken == {"reused": 0, "fresh": 1, "small": 0}
    kept = first[5:9]  # a view keeps the memory the caller's
    del first
    second = fetch_rows()
    assert second.data_ptr() != address and torch.equal(kept, rows[5:9]) and pool.taken["fresh"] == 2
    del kept, second  # every view of both dropped: both mappings idle, the next fetch reuses one
    third = fetch_rows()
    assert torch.equal(third, rows) and pool.taken["reused"] == 1
