"""Replicas' shared stores (replicas/shared.py: Shared, over an EmbeddingStore) against a real redis-server, for
the cache tests: entries, fast fault timings."""

from __future__ import annotations

import torch

from encoder_service.cache import EmbeddingStore, Entry
from encoder_service.replicas import Peers, RedisOptions, RedisTier, Shared

MIB = 1 << 20
# Timeouts and probe intervals short enough for tests to see faults and recoveries quickly.
# Row copies on: these stores have no HTTP server for another replica to fetch from, so rows go through Redis
# (--redis-row-copy-bytes); the replica-to-replica path is tested against real servers (tests/service/).
FAST = dict(socket_timeout_s=0.3, connect_timeout_s=0.3, probe_min_s=0.05, probe_max_s=0.2, recovery_grace_s=0.4,
            oom_pause_min_s=0.1, oom_pause_max_s=0.2, row_copy_bytes=1 << 30)
# The default timeouts, for tests that load the machine (hundreds of concurrent operations, dozens of new
# connections at once): on two shared cores the loop's lag alone can pass 0.3 s, which would read as "down".
LOADED = dict(socket_timeout_s=2.0, connect_timeout_s=1.0)
STATE_WAIT_S = 5.0  # bound on a background state change (the tier's probe, a subscription): FAST makes them quick


def make_entry(seed: int, num_rows=300, row_width=256, layout="main", dtype=torch.bfloat16) -> Entry:
    g = torch.Generator().manual_seed(seed)
    return Entry.from_rows(torch.randn(num_rows, row_width, generator=g).to(dtype), (1, 2, 2 * num_rows), layout)


async def open_store(url: str, local_bytes: int = 64 * MIB, **redis_options) -> Shared:
    """Started; its rows are make_entry's (no peer holds any: these replicas advertise no address)."""
    redis = RedisTier(url, RedisOptions(ttl_s=600, **{**FAST, **redis_options}))
    store = Shared(EmbeddingStore(local_bytes), redis, Peers(token=None, row_width=256, dtype=torch.bfloat16),
                   layout="main")
    await store.start()
    return store
