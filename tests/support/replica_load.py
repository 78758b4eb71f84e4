"""A bounded load across replicas sharing one Redis: pairs of "encode an image on one replica, fetch its rows
on the other" (the cross-replica fetch under test), then the same rows on the encoding replica (its own, from
its local tier: the reference). Run in phases (before, during, after a fault) through the project's clients,
which retry 503 / UNAVAILABLE within their timeout.

    load = Load(replicas, {"before": 32, "outage": 32, "after": 32})
    await load.run("before", clients)      # clients[k] talks to replicas[k]
    load.outcomes[phase]                   # Counter of the cross fetches' outcomes ("ok", or "<status> <error>")
    load.encoded                           # id -> (num_tokens, the encoding replica's rows)
    load.encoded_by                        # id -> the index of the replica that encoded it
    load.wrong_rows, load.local_failures
"""

from __future__ import annotations

import asyncio
import collections

import torch

from encoder_service import errors
from tests.support.images import image_bytes

CONCURRENCY = 12


class Load:
    def __init__(self, replicas, pairs: dict[str, int], *, concurrency: int = CONCURRENCY, seed: int = 50_000):
        self.replicas, self.pairs, self.concurrency, self.seed = replicas, pairs, concurrency, seed
        self.outcomes: dict[str, collections.Counter] = {phase: collections.Counter() for phase in pairs}
        self.encoded_by: dict[str, int] = {}  # id -> the index of the replica that encoded it
        self.wrong_rows = 0
        self.local_failures: list[str] = []
        self.encoded: dict[str, tuple[int, torch.Tensor]] = {}  # id -> (num_tokens, the encoding replica's rows)
        self._next_seed = 0

    async def run(self, phase: str, clients) -> None:
        """pairs[phase] pairs, at most `concurrency` at once, alternating which replica encodes."""
        seeds = range(self._next_seed, self._next_seed + self.pairs[phase])
        self._next_seed += self.pairs[phase]
        slots = asyncio.Semaphore(self.concurrency)

        async def pair(seed: int) -> None:
            async with slots:
                encoder, other = (clients[0], clients[1]) if seed % 2 == 0 else (clients[1], clients[0])
                await self._pair(phase, seed, encoder, other)

        await asyncio.gather(*(pair(s) for s in seeds))

    async def _pair(self, phase: str, seed: int, encoder, other) -> None:
        try:
            (info,) = await encoder.encode([image_bytes(64, 48, seed=self.seed + seed)])
        except errors.EncoderServiceError as exc:
            self.local_failures.append(f"encode: {exc}")
            return
        try:
            cross = (await other.fetch([(info.id, 0)], 0, info.num_tokens)).rows
            outcome = "ok"
        except errors.EncoderServiceError as exc:
            cross, outcome = None, f"{getattr(exc, 'status', None)} {exc}"[:200]
        self.outcomes[phase][outcome] += 1
        try:
            own = (await encoder.fetch([(info.id, 0)], 0, info.num_tokens)).rows
        except errors.EncoderServiceError as exc:
            self.local_failures.append(f"fetch on the encoding replica: {exc}")
            return
        self.encoded[info.id] = (info.num_tokens, own)
        self.encoded_by[info.id] = seed % 2
        if cross is not None and not torch.equal(cross, own):
            self.wrong_rows += 1
