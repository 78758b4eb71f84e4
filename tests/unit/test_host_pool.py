"""rowpath/host_pool.py: row memory handed back when the last tensor on it is gone, reused, never while
anything still refers to it; the idle bound; give-backs from other threads and from inside take."""

from __future__ import annotations

import gc
import math
import random
import threading

import torch

from encoder_service.rowpath.host_pool import PAGE, HostRowPool

MB = 1 << 20


def idle(pool: HostRowPool) -> int:
    return pool.stats()["idle_bytes"]


def test_take_gives_exactly_the_bytes_asked_for_owned_and_writable():
    pool = HostRowPool(min_bytes=MB)
    t = pool.take(3 * MB + 5)
    assert t.dtype == torch.uint8 and t.shape == (3 * MB + 5,) and t.is_contiguous() and not t.is_pinned()
    t.fill_(7)
    assert int(t.sum()) == 7 * (3 * MB + 5)
    rows = pool.take(2 * MB).view(torch.bfloat16).view(1024, 1024)  # how transfer.py shapes its rows
    assert rows.shape == (1024, 1024)
    assert pool.taken == {"reused": 0, "fresh": 2, "small": 0}


def test_small_rows_come_from_torch_and_min_bytes_inf_never_pools():
    pool = HostRowPool(min_bytes=MB)
    pool.take(MB - 1)  # dropped at once
    assert pool.taken["small"] == 1 and idle(pool) == 0
    off = HostRowPool(min_bytes=math.inf)
    off.take(64 * MB)  # dropped at once
    assert off.taken == {"reused": 0, "fresh": 0, "small": 1} and idle(off) == 0


def test_memory_comes_back_only_after_the_last_view_and_is_then_reused():
    pool = HostRowPool(min_bytes=MB)
    t = pool.take(2 * MB)
    address = t.data_ptr()
    part, array = t[100:200].view(torch.int16), t.numpy()
    del t
    gc.collect()
    assert idle(pool) == 0
    other = pool.take(2 * MB)
    assert other.data_ptr() != address  # still in use: a fresh mapping
    del part
    assert idle(pool) == 0  # the numpy array still holds it
    del array
    assert idle(pool) == 2 * MB
    again = pool.take(2 * MB)
    assert again.data_ptr() == address and pool.taken["reused"] == 1 and idle(pool) == 0
    del other, again


def test_an_idle_mapping_shrinks_or_grows_to_the_size_asked_for():
    pool = HostRowPool(min_bytes=MB)
    pool.take(8 * MB)  # dropped at once
    small = pool.take(3 * MB)  # the 8 MB mapping, shrunk
    assert pool.taken["reused"] == 1 and idle(pool) == 0
    small.fill_(1)
    del small
    assert idle(pool) == 3 * MB
    big = pool.take(5 * MB + 1)  # grown: its first 3 MB are pages already touched
    assert pool.taken["reused"] == 2
    big.fill_(2)
    assert int(big.sum()) == 2 * (5 * MB + 1)
    del big
    assert idle(pool) == 5 * MB + PAGE


def test_the_best_fit_is_the_smallest_idle_mapping_that_is_big_enough():
    pool = HostRowPool(min_bytes=MB)
    blocks = [pool.take(n * MB) for n in (2, 6, 4)]
    addresses = [b.data_ptr() for b in blocks]
    del blocks
    assert pool.take(3 * MB).data_ptr() == addresses[2]  # the 4 MB one, not the 6 MB one


def test_idle_memory_is_bounded_oldest_first():
    pool = HostRowPool(min_bytes=MB, max_idle_bytes=5 * MB)
    blocks = [pool.take(2 * MB) for _ in range(4)]
    addresses = [b.data_ptr() for b in blocks]
    for i in range(4):  # given back in take order
        blocks[i] = None
    assert idle(pool) == 4 * MB  # the two given back first went back to the kernel
    kept = [pool.take(2 * MB), pool.take(2 * MB)]
    assert {t.data_ptr() for t in kept} == set(addresses[2:]) and idle(pool) == 0


def test_never_hands_out_memory_a_live_tensor_uses():
    """A seeded random walk of takes (sizes that shrink and grow idle mappings) and drops, each live tensor
    (or another tensor on its storage, the one take gave dropped) filled with its own byte: after every step
    the live ones are disjoint and still hold their byte."""
    rng = random.Random(0)
    pool = HostRowPool(min_bytes=PAGE, max_idle_bytes=24 * PAGE)
    live: dict[int, torch.Tensor] = {}
    for step in range(400):
        if live and rng.random() < 0.45:
            del live[rng.choice(list(live))]
        else:
            t = pool.take(rng.choice([1, 2, 3, 5, 8]) * PAGE - rng.randrange(3))
            t.fill_(step % 251)
            if rng.random() < 0.5:  # or only another tensor on its storage lives on (no Python tie to t)
                t = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            live[step] = t
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in live.values())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert all(bool((t == k % 251).all()) for k, t in live.items())
    assert pool.taken["reused"] > 100 and idle(pool) <= 24 * PAGE


def test_a_give_back_while_the_lock_is_held_waits_for_the_holder():
    """A tensor freed inside take (a garbage collection there) must not wait for the lock take holds."""
    pool = HostRowPool(min_bytes=MB)
    t = pool.take(2 * MB)
    with pool._lock:
        del t  # the finalizer runs here, on the thread holding the lock
        assert pool._idle_bytes == 0 and len(pool._returned) == 1
    assert idle(pool) == 2 * MB  # filed by the next caller
    assert pool.take(2 * MB) is not None and pool.taken["reused"] == 1


def test_give_backs_from_other_threads():
    """Four threads drop their tensors while this one takes: every mapping comes back, none twice."""
    pool = HostRowPool(min_bytes=PAGE, max_idle_bytes=1 << 40)
    batches = [[pool.take(PAGE * (1 + i % 3)) for i in range(50)] for _ in range(4)]

    def drop(batch):
        while batch:
            batch.pop()

    threads = [threading.Thread(target=drop, args=(b,)) for b in batches]
    for th in threads:
        th.start()
    kept = [pool.take(PAGE) for _ in range(50)]  # takes while the give-backs run
    for th in threads:
        th.join()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in kept)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    del kept
    stats = pool.stats()
    assert stats["fresh"] + stats["reused"] == 250 and stats["idle_mappings"] == stats["fresh"]


def test_huge_pages_only_advise():
    pool = HostRowPool(min_bytes=MB, huge_pages=True)
    t = pool.take(4 * MB + 3)
    t.fill_(3)
    assert int(t.sum()) == 3 * (4 * MB + 3)
    del t
    assert pool.take(4 * MB).numel() == 4 * MB and pool.stats()["reused"] == 1


def test_takes_from_several_threads_get_disjoint_memory_and_are_all_counted():
    """The client's fetch threads take at once (client/destination.py)."""
    pool = HostRowPool(min_bytes=PAGE)
    kept: list[list[torch.Tensor]] = [[] for _ in range(4)]

    def take(mine: list[torch.Tensor]):
        for i in range(100):
            t = pool.take(PAGE * (1 + i % 3))
            if i % 2:
                mine.append(t)  # the others are dropped at once: reused by any thread

    threads = [threading.Thread(target=take, args=(k,)) for k in kept]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    live = [t for mine in kept for t in mine]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in live)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert pool.taken["fresh"] + pool.taken["reused"] == 400


def test_close_gives_the_idle_mappings_back_and_keeps_none_after():
    pool = HostRowPool(min_bytes=MB)
    held = pool.take(2 * MB)
    pool.take(3 * MB)  # dropped at once: idle
    assert idle(pool) == 3 * MB
    pool.close()
    assert idle(pool) == 0
    del held  # given back after the close: not kept either
    assert idle(pool) == 0 and pool.stats()["idle_mappings"] == 0


def _faults_writing_every_page(tensor: torch.Tensor) -> int:
    """Minor page faults of this thread while it writes one byte per page of `tensor` (numpy: on this thread
    alone, where torch would spread the writes over its intra-op threads, whose faults are not counted here)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    tensor.numpy()[::PAGE] = 1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_mappings_are_faulted_in_ahead_of_the_takes_that_use_them():
    """prefault_bytes: while the idle mappings hold less, a background thread maps more (the size of the
    largest recent take), their pages already in: writing every page of one faults far less on this thread
    than writing a fresh mapping's (4 KiB pages: next to nothing against one fault a page; huge pages, where
    the kernel grants them to fresh mappings: still fewer)."""
    from tests.support.waits import wait_for

    size = 8 * MB
    fresh = _faults_writing_every_page(HostRowPool(min_bytes=MB).take(size))
    pool = HostRowPool(min_bytes=MB, prefault_bytes=3 * size)
    try:
        held = [pool.take(size)]  # fresh; kept, so nothing comes back to the pool
        wait_for(lambda: pool.stats()["prefaulted"] == 3 and idle(pool) == 3 * size, "three mappings ahead", 10)
        assert pool.taken == {"reused": 0, "fresh": 1, "small": 0}
        held.append(pool.take(size))
        ahead = _faults_writing_every_page(held[-1])
        assert pool.taken["reused"] == 1 and ahead * 4 < fresh, (ahead, fresh)
        wait_for(lambda: pool.stats()["prefaulted"] == 4, "the one taken made again", 10)
        assert idle(pool) == 3 * size  # no more than prefault_bytes ahead
    finally:
        pool.close()
    assert not pool._prefaulter.is_alive() and idle(pool) == 0  # close joined it


def test_prefaulting_stays_inside_the_idle_bound():
    from tests.support.waits import wait_for

    pool = HostRowPool(min_bytes=MB, max_idle_bytes=4 * MB, prefault_bytes=64 * MB)
    assert pool.prefault_bytes == 4 * MB
    try:
        held = pool.take(5 * MB)  # larger than the bound: nothing is made ahead
        wait_for(lambda: pool.prefault_passes >= 1, "the prefault thread to look", 10)
        assert pool.stats()["prefaulted"] == 0 and idle(pool) == 0
        del held
    finally:
        pool.close()
