"""Host LRU tier: byte bound, leases (pins), pin bound."""

from __future__ import annotations

import pytest
import torch

from encoder_service.cache.entry import Entry
from encoder_service.cache.local import LocalTier
from encoder_service.errors import Overloaded

KIB = 1024


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(kib: int = 4, seed: int = 0) -> Entry:
    rows = torch.full((kib, 256), float(seed))  # kib rows of 1 KiB (fp32)
    return Entry.from_rows(rows, (1, 2, 2 * kib), "main")


def test_lru_is_bounded_in_bytes_and_evicts_oldest():
    tier = LocalTier(40 * KIB)
    for i in range(10):
        assert tier.put(f"k{i}", entry(4, i))
    tier.get("k0")  # k0 becomes most recently used
    assert tier.put("k10", entry(8, 10))
    assert tier.used_bytes <= 40 * KIB
    assert "k0" in tier and "k1" not in tier and "k2" not in tier and "k10" in tier
    assert tier.counters["evictions"] == 2
    assert not tier.put("huge", entry(41))  # larger than the whole tier: not cached
    assert "huge" not in tier and tier.counters["too_big"] == 1


def test_pinned_entries_survive_lru_pressure():
    tier = LocalTier(40 * KIB, 20 * KIB)
    tier.put("pinned", entry(4, 1))
    tier.pin("pinned", lease_s=60)
    for i in range(100):
        tier.put(f"other{i}", entry(4, i))
    got = tier.get("pinned")
    assert got is not None and torch.equal(got.tensor, entry(4, 1).tensor)
    assert tier.used_bytes <= 40 * KIB and tier.counters["evictions"] >= 90


def test_pin_bound_raises_overloaded_not_eviction():
    tier = LocalTier(40 * KIB, 10 * KIB)
    for i in range(3):
        tier.put(f"k{i}", entry(4, i))
    tier.pin("k0", 60)
    tier.pin("k1", 60)
    with pytest.raises(Overloaded, match="max-pinned-bytes"):
        tier.pin("k2", 60)
    assert tier.is_pinned("k0") and tier.is_pinned("k1") and not tier.is_pinned("k2")
    assert tier.pinned_bytes == 8 * KIB and tier.counters["pin_refused"] == 1
    tier.release("k0")
    tier.pin("k2", 60)  # room again after a release


def test_lease_expiry_unpins_and_entry_becomes_evictable():
    clock = FakeClock()
    tier = LocalTier(16 * KIB, 8 * KIB, clock=clock)
    tier.put("a", entry(4, 1))
    tier.pin("a", lease_s=5)
    clock.now += 4.9
    assert tier.is_pinned("a")
    clock.now += 0.2
    assert not tier.is_pinned("a") and tier.pinned_bytes == 0
    assert tier.counters["lease_expired"] == 1
    for i in range(4):
        tier.put(f"b{i}", entry(4, i))
    assert "a" not in tier  # evicted like any other entry once its lease ended


def test_pins_count_holders_and_extend_the_deadline():
    clock = FakeClock()
    tier = LocalTier(16 * KIB, 8 * KIB, clock=clock)
    tier.put("a", entry(4))
    tier.pin("a", 10)
    clock.now += 5
    tier.pin("a", 10)  # a second request for the same image: deadline now +15 from the start
    assert tier.pinned_bytes == 4 * KIB  # counted once
    assert tier.release("a") and tier.is_pinned("a")  # the other holder still reads it
    clock.now += 9
    assert tier.is_pinned("a")  # past the first deadline, inside the extended one
    assert tier.release("a") and not tier.is_pinned("a")
    assert not tier.release("a")


def test_pin_before_the_entry_exists_reserves_bytes():
    tier = LocalTier(16 * KIB, 8 * KIB)
    with pytest.raises(ValueError, match="nbytes"):
        tier.pin("later", 10)
    tier.pin("later", 10, nbytes=5 * KIB)  # engine's estimate at encode time
    assert tier.pinned_bytes == 5 * KIB
    with pytest.raises(Overloaded):
        tier.pin("other", 10, nbytes=4 * KIB)
    tier.put("later", entry(4))  # the real entry lands: its size replaces the reservation
    assert tier.pinned_bytes == 4 * KIB
    for i in range(10):
        tier.put(f"x{i}", entry(4, i))
    assert "later" in tier


def test_max_pinned_must_fit_in_capacity():
    with pytest.raises(ValueError):
        LocalTier(10, 11)
