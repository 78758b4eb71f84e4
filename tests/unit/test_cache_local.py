"""Host LRU tier: byte bound, leases (pins), pin bound."""

from __future__ import annotations

import pytest
import torch

from encoder_service.cache import local
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


def test_a_full_fetch_ends_one_holder_and_the_entry_stays_cached():
    tier = LocalTier(40 * KIB, 8 * KIB)
    tier.put("a", entry(4, 1))
    tier.pin("a", 60)
    assert tier.delivered("a", 4, [(0, 4)]) == 1
    assert not tier.is_pinned("a") and tier.pinned_bytes == 0 and tier.counters["fetch_ended"] == 1
    got = tier.get("a")  # an ordinary LRU entry now, most recently used
    assert got is not None and torch.equal(got.tensor, entry(4, 1).tensor)
    assert tier.delivered("a", 4, [(0, 4)]) == 0  # not pinned: nothing to end
    assert tier.release("a")  # the client's own release after its fetch: the ended holder's, counted
    assert not tier.release("a")


def test_chunked_fetches_add_up_and_end_the_pin_only_after_the_last_rows():
    tier = LocalTier(40 * KIB, 8 * KIB)
    tier.pin("a", 60, nbytes=4 * KIB)  # pinned at encode time, before the rows exist
    assert tier.delivered("a", 4, [(2, 3)]) == 0
    assert tier.delivered("a", 4, [(0, 2), (1, 2)]) == 0  # overlapping ranges of one fetch: each row once
    assert tier.delivered("a", 4, [(2, 3)]) == 0  # a re-fetch of a row: row 3 is still missing
    assert tier.is_pinned("a")
    assert tier.delivered("a", 4, [(3, 4)]) == 1 and not tier.is_pinned("a")


def test_two_holders_end_one_per_full_delivery():
    tier = LocalTier(40 * KIB, 8 * KIB)
    tier.put("a", entry(4))
    tier.pin("a", 60)
    tier.pin("a", 60)  # two requests encoded the same image
    assert tier.delivered("a", 4, [(0, 4)]) == 1 and tier.is_pinned("a")  # one of them read every row
    # The other reads in two chunks, a third request (which pins no more) reads half: no second full delivery.
    assert tier.delivered("a", 4, [(0, 2)]) == 0 and tier.delivered("a", 4, [(0, 2)]) == 0
    assert tier.is_pinned("a")
    assert tier.delivered("a", 4, [(2, 4)]) == 1 and not tier.is_pinned("a")


def test_interleaved_chunks_of_two_readers_end_both_holders():
    tier = LocalTier(40 * KIB, 8 * KIB)
    tier.put("a", entry(4))
    tier.pin("a", 60)
    tier.pin("a", 60)
    assert tier.delivered("a", 4, [(0, 2)]) == 0  # reader 1, chunk 1
    assert tier.delivered("a", 4, [(0, 2)]) == 0  # reader 2, chunk 1
    assert tier.delivered("a", 4, [(2, 4)]) == 1  # reader 1, chunk 2: every row delivered once
    assert tier.is_pinned("a")
    assert tier.delivered("a", 4, [(2, 4)]) == 1 and not tier.is_pinned("a")  # reader 2, chunk 2


def test_a_release_after_a_full_fetch_does_not_end_another_requests_pin():
    tier = LocalTier(40 * KIB, 8 * KIB)
    tier.put("a", entry(4))
    tier.pin("a", 60)
    assert tier.delivered("a", 4, [(0, 4)]) == 1  # request 1 read every row: its pin ended
    tier.pin("a", 60)  # request 2 encodes the same image
    assert tier.release("a")  # request 1's release, late: it drops request 1's ended holder
    assert tier.is_pinned("a")  # request 2's pin stands
    assert tier.release("a") and not tier.is_pinned("a")
    assert tier.stats()["ended_keys"] == 0


def test_unpin_gives_back_a_live_holder_not_an_ended_one():
    tier = LocalTier(40 * KIB, 8 * KIB)
    tier.put("a", entry(4))
    tier.pin("a", 60)
    tier.delivered("a", 4, [(0, 4)])
    tier.pin("a", 60)  # a new encode pins ...
    assert tier.unpin("a") and not tier.is_pinned("a")  # ... and gives its pin back (its request failed)
    assert tier.release("a")  # the ended holder is still there for its client's release
    assert not tier.unpin("a") and not tier.release("a")


def test_ended_holders_are_forgotten_with_their_lease_and_bounded(monkeypatch):
    clock = FakeClock()
    tier = LocalTier(40 * KIB, 8 * KIB, clock=clock)
    tier.put("a", entry(4))
    tier.pin("a", 5)
    tier.delivered("a", 4, [(0, 4)])
    clock.now += 5.1
    assert tier.stats()["ended_keys"] == 0 and not tier.release("a")  # as a pin whose lease ended
    assert tier.counters["lease_expired"] == 0  # the pin itself ended by the fetch

    monkeypatch.setattr(local, "ENDED_KEPT", 2)
    for k in range(3):
        tier.pin(f"k{k}", 60, nbytes=1)
        assert tier.delivered(f"k{k}", 1, [(0, 1)]) == 1
    assert tier.stats()["ended_keys"] == 2 and not tier.release("k0")  # the oldest went
    assert tier.release("k1") and tier.release("k2")


def test_row_counts_take_whole_deliveries_and_merge_steps():
    counts = local._RowCounts(10)
    for start, end in [(0, 3), (3, 10), (5, 7), (0, 10)]:
        counts.add(start, end)
    assert counts.take_full() == 2  # every row twice; rows 5 and 6 a third time
    assert counts.starts == [0, 5, 7] and counts.counts == [0, 1, 0]
    assert counts.take_full() == 0
    counts.add(0, 5)
    counts.add(7, 10)
    assert counts.take_full() == 1 and counts.starts == [0] and counts.counts == [0]


def test_the_pins_full_error_says_what_to_do():
    tier = LocalTier(40 * KIB, 4 * KIB)
    tier.pin("a", 60, nbytes=3 * KIB)
    with pytest.raises(Overloaded) as exc:
        tier.pin("b", 60, nbytes=2 * KIB)
    message = str(exc.value)
    for words in ("3072 bytes of embeddings are pinned (1 ids)", "2048 more would pass --max-pinned-bytes (4096)",
                  "delivered every one of its rows", "release", "--lease-s", "raise --max-pinned-bytes"):
        assert words in message, (words, message)


def test_leased_keys_keep_a_fully_fetched_id_until_its_lease_ends():
    """What the store writes to Redis again after an outage: other replicas may still fetch such an id."""
    clock = FakeClock()
    tier = LocalTier(40 * KIB, 12 * KIB, clock=clock)
    for key in ("fetched", "released", "pinned"):
        tier.put(key, entry(4))
        tier.pin(key, 10)
    tier.delivered("fetched", 4, [(0, 4)])
    tier.delivered("released", 4, [(0, 4)])
    tier.release("released")
    assert sorted(tier.leased_keys()) == ["fetched", "pinned"]
    clock.now += 10.1
    assert tier.leased_keys() == []
