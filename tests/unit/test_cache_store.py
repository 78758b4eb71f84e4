"""EmbeddingStore, what this process holds: put and read back, leases through the store. (The single flight
is the core's: tests/unit/test_core.py; the face over it without Redis, replicas/solo.py: test_cache_directory.py.)"""

from __future__ import annotations

import pytest
import torch

from encoder_service.cache import EmbeddingStore, Entry
from encoder_service.errors import InvalidInput, Overloaded
from encoder_service.replicas import Solo

MIB = 1 << 20


def rows(seed: int, num_rows: int = 32, width: int = 64) -> torch.Tensor:
    return torch.randn(num_rows, width, generator=torch.Generator().manual_seed(seed))


def entry(seed: int) -> Entry:
    return Entry.from_rows(rows(seed), (1, 8, 16), "main")


def test_put_then_get_and_read_rows():
    store = EmbeddingStore(16 * MIB)
    assert store.get("k") is None and store.rows("k", 0, 1) is None
    stored = entry(3)
    store.put("k", stored)
    assert store.get("k") is stored
    assert torch.equal(store.rows("k", 4, 20), rows(3)[4:20])
    with pytest.raises(InvalidInput):
        store.rows("k", 0, 33)


def test_chunked_fetch_keeps_the_pin_until_release():
    entry_bytes = 32 * 64 * 4
    store = EmbeddingStore(4 * entry_bytes, max_pinned_bytes=entry_bytes)
    store.pin("img", nbytes=entry_bytes)  # at encode time, before the ViT ran
    with pytest.raises(Overloaded):
        store.pin("img2", nbytes=entry_bytes)
    store.put("img", entry(1))
    for start in range(0, 32, 8):  # four prefill chunks, with LRU pressure between them
        for i in range(6):
            store.put(f"filler{start}-{i}", entry(10 + i))
        assert torch.equal(store.rows("img", start, start + 8), rows(1)[start : start + 8])
    assert store.stats()["local_pinned_keys"] == 1
    assert store.release("img")
    assert store.stats()["local_pinned_keys"] == 0


async def test_peek_and_header_neither_count_nor_promote():
    entry_bytes = 32 * 64 * 4
    store = EmbeddingStore(2 * entry_bytes)
    entries = [entry(i) for i in range(2)]
    for i, e in enumerate(entries):
        store.put(f"k{i}", e)
    before = store.stats()
    assert store.peek("k0") is entries[0] and store.peek("unknown") is None
    solo = Solo(store)  # the face without Redis: headers of what this process holds
    assert await solo.header("k0") == entries[0].header and await solo.header("unknown") is None
    assert store.stats() == before  # no local hit/miss counted
    store.put("k2", entry(9))
    assert store.peek("k0") is None and store.peek("k1") is entries[1]  # k0 stayed the oldest: evicted
