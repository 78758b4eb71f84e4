"""core/cache_metrics.py: the store's and the shm writer's stats as Prometheus metrics, read at scrape time.
(tests/service/test_operability.py scrapes a real service: values move as it encodes, evicts, loses Redis.)"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from encoder_service.cache import EmbeddingStore, Entry
from encoder_service.core.cache_metrics import PEERS, SHM, STORE, CacheCollector
from encoder_service.core.shm_writer import ShmWriter
from encoder_service.replicas import Peers, RedisTier, Shared


def scrape(registry: CollectorRegistry) -> dict:
    """{(sample name, sorted labels): value} from the text exposition, parsed as Prometheus would."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}


def test_every_stat_has_a_described_metric(tmp_path):
    peers = Peers(token=None, row_width=8, dtype=torch.float32)
    store = Shared(EmbeddingStore(1 << 20), RedisTier("redis://127.0.0.1:1/0"), peers, layout="main")  # never
    shm = ShmWriter(str(tmp_path))  # started: no connection is made
    try:
        assert set(store.stats()) <= set(STORE) | set(PEERS), "give each new stat a row in core/cache_metrics.py"
        assert set(shm.stats()) <= set(SHM)
        peers.close()
    finally:
        shm.close()


def test_values_are_read_at_scrape_time():
    store = EmbeddingStore(4096, max_pinned_bytes=2048)
    registry = CollectorRegistry()
    registry.register(CacheCollector(store))
    before = scrape(registry)
    assert before[("encoder_cache_local_capacity_bytes", ())] == 4096
    assert before[("encoder_cache_max_pinned_bytes", ())] == 2048
    assert before[("encoder_cache_local_evictions_total", ())] == 0
    assert ("encoder_cache_redis_up", ()) not in before and not any(n.startswith("encoder_shm") for n, _ in before)

    entries = [Entry.from_rows(torch.zeros(8, 48), (1, 4, 8), "main") for _ in range(6)]  # ~1.6 KiB each
    for k, entry in enumerate(entries):
        store.local.put(f"k{k}", entry)
    store.local.get("k5")
    store.local.get("gone")
    after = scrape(registry)
    assert after[("encoder_cache_local_inserts_total", ())] == 6
    assert after[("encoder_cache_local_evictions_total", ())] == 6 - after[("encoder_cache_local_entries", ())]
    assert 0 < after[("encoder_cache_local_used_bytes", ())] <= 4096
    assert after[("encoder_cache_local_lookups_total", (("result", "hit"),))] == 1
    assert after[("encoder_cache_local_lookups_total", (("result", "miss"),))] == 1


def test_a_stat_without_a_row_is_still_exported():
    class Store:
        def stats(self):
            return {"local_evictions": 3, "brand_new_counter": 7, "redis_state": "down", "note": "text"}

    registry = CollectorRegistry()
    registry.register(CacheCollector(Store()))
    values = scrape(registry)
    assert values[("encoder_cache_local_evictions_total", ())] == 3
    assert values[("encoder_cache_brand_new_counter", ())] == 7
    assert values[("encoder_cache_redis_up", ())] == 0
    assert not any("note" in name for name, _ in values)
