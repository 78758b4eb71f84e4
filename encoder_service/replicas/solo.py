"""`Solo`: the face (face.py) of a replica alone, without Redis. Nothing is shared: reads and writes are this
process's store, nothing is claimed, bound or waited for, and a fetch must reach the replica that encoded the
id (the chart's `service.sessionAffinity: ClientIP` does that for one client pod; deploy/README.md, "Scaling
out")."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

import torch

from encoder_service import errors
from encoder_service.cache import CacheKey, EmbeddingStore, Entry, EntryHeader
from encoder_service.replicas.directory import Located, Marked, Settled
from encoder_service.replicas.face import Claimed, Key, TakeOver
from encoder_service.timeouts import Deadline


class Solo:
    owner = None
    owner_url = None

    def __init__(self, store: EmbeddingStore):
        self.store = store

    def advertise(self, url: str | None) -> None:
        pass  # nobody asks

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def readiness(self) -> dict:
        return {"redis": "off"}

    def stats(self) -> dict:
        return self.store.stats()

    # ---- reads, writes: the store's ---------------------------------------------------------------------
    async def get(self, key: Key) -> Entry | None:
        return self.store.get(key)

    async def header(self, key: Key) -> EntryHeader | None:
        entry = self.store.peek(key)
        return entry.header if entry is not None else None

    async def locate(self, key: Key, *, strict: bool = True) -> Located | None:
        return None

    async def pull(self, key: CacheKey) -> Entry | None:
        return None

    def put(self, key: Key, entry: Entry) -> None:
        self.store.put(key, entry)

    def failed(self, key: Key, exc: BaseException) -> None:
        pass  # nobody waits elsewhere

    async def withdraw(self, key: Key, tag: int) -> None:
        pass

    # ---- claims, bindings, waits: none --------------------------------------------------------------------
    async def bind_tags(self, tags: Mapping[CacheKey, int]) -> dict[str, int]:
        return {}

    def mark(self, misses: Sequence[Claimed], hits: Sequence[CacheKey]) -> asyncio.Task | None:
        return None

    async def mark_pending(self, keys: Iterable[Key], lease_s: float | None = None,
                           tags: Mapping[str, int] | None = None, inputs: Mapping[str, bytes] | None = None
                           ) -> Marked:
        return Marked(False)

    async def wait_for(self, key: Key, timeout_s: float | None) -> Settled:
        return Settled.NOT_PENDING

    async def input(self, key: Key) -> bytes | None:
        return None

    # ---- a fetch of an id not here: nowhere else to look ----------------------------------------------------
    async def num_tokens_elsewhere(self, key: CacheKey, deadline: Deadline, take_over: TakeOver) -> int:
        raise errors.NotFound(f"unknown id {key.id!r}: never encoded here, or evicted (encode it again; "
                              "without Redis a fetch must reach the replica that encoded the id)")

    async def rows_elsewhere(self, key: CacheKey, start: int, end: int, take_over: TakeOver
                             ) -> torch.Tensor | None:
        return None
