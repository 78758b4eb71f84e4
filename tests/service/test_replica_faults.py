"""Two real replicas sharing one real redis-server, under bounded load while Redis is killed and restarted
on the same port (issue 13): never a wrong row, and once Redis is back (one probe interval and a margin
after the restart) every fetch on the other replica of an id encoded then succeeds.

The load is a fixed number of pairs per phase, at most CONCURRENCY at once. A pair: encode an image
(no wait) on one replica, fetch its rows on the other (the cross-replica fetch under test), and fetch them
on the encoding replica too (its own rows, from its local tier: the reference). Phases: before the kill,
during the outage, right after the restart (the tiers recovering), after the recovery. Every cross fetch
that succeeds must equal the reference bit for bit in every phase; failures are counted per phase and
status, and must be none before the kill and after the recovery. The encoding replica answers its own
encode and fetch throughout (its local tier does not need Redis).
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
import torch

from encoder_service import errors
from encoder_service.cache.redis_tier import RedisTier
from encoder_service.client import AsyncEncoderClient
from tests.support.images import image_bytes
from tests.support.service import RunningService, running

pytestmark = pytest.mark.timeout(120)

CONCURRENCY = 12
PAIRS = {"before": 32, "outage": 32, "recovering": 16, "after": 48}
PROBE_INTERVAL_S = RedisTier.__init__.__kwdefaults__["probe_max_s"]  # the service's (no flag changes it)
RECOVERY_MARGIN_S = 0.75
FETCH_TIMEOUT_S = 10.0


class Load:
    def __init__(self, replicas: tuple[RunningService, RunningService]):
        self.replicas = replicas
        self.outcomes: dict[str, collections.Counter] = {phase: collections.Counter() for phase in PAIRS}
        self.wrong_rows = 0
        self.local_failures: list[str] = []
        self._next_seed = 0

    async def run(self, phase: str, clients) -> None:
        """PAIRS[phase] pairs, at most CONCURRENCY at once, alternating which replica encodes."""
        seeds = range(self._next_seed, self._next_seed + PAIRS[phase])
        self._next_seed += PAIRS[phase]
        slots = asyncio.Semaphore(CONCURRENCY)

        async def pair(seed: int) -> None:
            async with slots:
                encoder, other = (clients[0], clients[1]) if seed % 2 == 0 else (clients[1], clients[0])
                await self._pair(phase, seed, encoder, other)

        await asyncio.gather(*(pair(s) for s in seeds))

    async def _pair(self, phase: str, seed: int, encoder, other) -> None:
        try:
            (info,) = await encoder.encode([image_bytes(64, 48, seed=50_000 + seed)])
        except errors.EncoderServiceError as exc:
            self.local_failures.append(f"encode: {exc}")
            return
        try:
            cross = (await other.fetch([(info.id, 0)], 0, info.num_tokens)).rows
            outcome = "ok"
        except errors.EncoderServiceError as exc:
            cross, outcome = None, str(exc.status)  # the HTTP status
        self.outcomes[phase][outcome] += 1
        try:
            own = (await encoder.fetch([(info.id, 0)], 0, info.num_tokens)).rows
        except errors.EncoderServiceError as exc:
            self.local_failures.append(f"fetch on the encoding replica: {exc}")
            return
        if cross is not None and not torch.equal(cross, own):
            self.wrong_rows += 1


def redis_state(svc: RunningService) -> str:
    """What /health/ready says of Redis, read on the service's loop."""

    async def state() -> str:
        return svc.core.readiness()["redis"]

    return svc.call(state)


def test_redis_killed_and_restarted_under_load(request, tiny_checkpoint, redis_server):
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    replicas = (running(request, checkpoint, "--redis-url", redis_server.url),
                running(request, checkpoint, "--redis-url", redis_server.url))
    load = Load(replicas)

    async def scenario() -> None:
        clients = [AsyncEncoderClient.http(r.url, timeout=FETCH_TIMEOUT_S) for r in replicas]
        try:
            await load.run("before", clients)
            redis_server.kill()
            await load.run("outage", clients)
            assert [redis_state(r) for r in replicas] == ["down", "down"]  # both saw it go
            redis_server.start()  # same port, empty (persistence is off)
            recovered_at = time.monotonic() + PROBE_INTERVAL_S + RECOVERY_MARGIN_S
            await load.run("recovering", clients)
            await asyncio.sleep(max(0.0, recovered_at - time.monotonic()))
            assert [redis_state(r) for r in replicas] == ["up", "up"]  # within one probe interval
            await load.run("after", clients)
        finally:
            for client in clients:
                await client.close()

    t0 = time.monotonic()
    asyncio.run(scenario())
    elapsed = time.monotonic() - t0
    print(f"\n{sum(PAIRS.values())} pairs in {elapsed:.1f}s; cross-replica fetches by phase: "
          + "; ".join(f"{p}: {dict(c)}" for p, c in load.outcomes.items()))
    assert load.wrong_rows == 0
    assert load.local_failures == []  # the encoding replica serves its own ids throughout
    assert load.outcomes["before"] == {"ok": PAIRS["before"]}
    assert load.outcomes["after"] == {"ok": PAIRS["after"]}  # 0 failed fetches of ids encoded after recovery
    # During the outage a cross-replica fetch cannot see the other replica's rows: it says so at once.
    assert set(load.outcomes["outage"]) <= {"ok", "503", "404"}
