"""EmbeddingStore without Redis: single flight, failures, cancellation, leases through the store."""

from __future__ import annotations

import asyncio

import pytest
import torch

from encoder_service.cache import EmbeddingStore, Entry, make_key
from encoder_service.errors import InvalidInput, Overloaded

MIB = 1 << 20


def rows(seed: int, num_rows: int = 32, width: int = 64) -> torch.Tensor:
    return torch.randn(num_rows, width, generator=torch.Generator().manual_seed(seed))


class CountingEncoder:
    """A `create` factory that counts calls and waits for `gate` before answering."""

    def __init__(self, seed: int = 0, fail: Exception | None = None):
        self.calls = 0
        self.gate = asyncio.Event()
        self.seed, self.fail = seed, fail

    async def __call__(self) -> Entry:
        self.calls += 1
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return Entry.from_rows(rows(self.seed), (1, 8, 16), "main")


async def test_concurrent_identical_requests_encode_once():
    store = EmbeddingStore(16 * MIB)
    key = make_key(b"same image", "fp")
    enc = CountingEncoder()
    tasks = [asyncio.create_task(store.get_or_create(key, enc)) for _ in range(50)]
    await asyncio.sleep(0)  # let all 50 reach the in-flight task
    enc.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert enc.calls == 1
    assert all(entry is results[0][0] for entry, _ in results)
    assert sorted(cached for _, cached in results) == [False] + [True] * 49
    assert store.stats()["joins"] == 49 and store.stats()["creates"] == 1
    again, cached = await store.get_or_create(key, enc)
    assert cached and again is results[0][0] and enc.calls == 1


async def test_failure_reaches_every_waiter_and_is_not_cached():
    store = EmbeddingStore(16 * MIB)
    enc = CountingEncoder(fail=RuntimeError("ViT batch failed"))
    tasks = [asyncio.create_task(store.get_or_create("k", enc)) for _ in range(10)]
    await asyncio.sleep(0)
    enc.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)
    assert enc.calls == 1 and all(isinstance(r, RuntimeError) for r in results)
    assert await store.get("k") is None and store.stats()["fill_failures"] == 1
    ok = CountingEncoder()
    ok.gate.set()
    entry, cached = await store.get_or_create("k", ok)  # tried again, not a cached failure
    assert not cached and ok.calls == 1 and torch.equal(entry.tensor, rows(0))


async def test_cancelled_first_caller_does_not_cancel_the_shared_encode():
    store = EmbeddingStore(16 * MIB)
    enc = CountingEncoder()
    first = asyncio.create_task(store.get_or_create("k", enc))
    await asyncio.sleep(0)
    second = asyncio.create_task(store.get_or_create("k", enc))
    await asyncio.sleep(0)
    first.cancel()
    enc.gate.set()
    entry, _ = await asyncio.wait_for(second, timeout=5)
    assert first.cancelled() and enc.calls == 1
    assert (await store.get("k")) is entry


async def test_read_rows_waits_for_an_encode_in_flight():
    store = EmbeddingStore(16 * MIB)
    enc = CountingEncoder(seed=3)
    fill = asyncio.create_task(store.get_or_create("k", enc))
    await asyncio.sleep(0)
    reader = asyncio.create_task(store.read_rows("k", 4, 20))
    await asyncio.sleep(0)
    assert not reader.done()
    enc.gate.set()
    got = await asyncio.wait_for(reader, timeout=5)
    assert torch.equal(got, rows(3)[4:20])
    await fill
    assert await store.read_rows("unknown", 0, 1) is None
    with pytest.raises(InvalidInput):
        await store.read_rows("k", 0, 33)


async def test_chunked_fetch_keeps_the_pin_until_release():
    entry_bytes = 32 * 64 * 4
    store = EmbeddingStore(4 * entry_bytes, max_pinned_bytes=entry_bytes)
    enc = CountingEncoder(seed=1)
    enc.gate.set()
    store.pin("img", nbytes=entry_bytes)  # at encode time, before the ViT ran
    with pytest.raises(Overloaded):
        store.pin("img2", nbytes=entry_bytes)
    await store.get_or_create("img", enc)
    for start in range(0, 32, 8):  # four prefill chunks, with LRU pressure between them
        for i in range(6):
            filler = CountingEncoder(seed=10 + i)
            filler.gate.set()
            await store.get_or_create(f"filler{start}-{i}", filler)
        assert torch.equal(await store.read_rows("img", start, start + 8), rows(1)[start : start + 8])
    assert store.stats()["local_pinned_keys"] == 1
    assert store.release("img")
    assert store.stats()["local_pinned_keys"] == 0


async def test_peek_and_header_neither_count_nor_promote():
    entry_bytes = 32 * 64 * 4
    store = EmbeddingStore(2 * entry_bytes)
    entries = []
    for i in range(2):
        enc = CountingEncoder(seed=i)
        enc.gate.set()
        entries.append((await store.get_or_create(f"k{i}", enc))[0])
    before = store.stats()
    assert store.peek("k0") is entries[0] and store.peek("unknown") is None
    assert await store.header("k0") == entries[0].header and await store.header("unknown") is None
    assert store.stats() == before  # no local hit/miss counted
    filler = CountingEncoder(seed=9)
    filler.gate.set()
    await store.get_or_create("k2", filler)
    assert store.peek("k0") is None and store.peek("k1") is entries[1]  # k0 stayed the oldest: evicted


async def test_create_must_return_an_entry():
    store = EmbeddingStore(MIB)

    async def bad():
        return rows(0)

    with pytest.raises(TypeError, match="expected Entry"):
        await store.get_or_create("k", bad)
