"""The cache's own counters on /metrics: one Prometheus collector reading `replicas.stats()` (the face the
core holds, replicas/face.py: the host LRU tier and leases, and, shared, the Redis tier and the peer row
path) and the shared-memory writer's `stats()` when Prometheus scrapes.

Nothing is counted per request: the store and the writer keep their counters as they always do, and a
scrape reads them. On the event loop, where the store lives (the /metrics handler runs there): a reader on
another thread goes through the loop (as tests/support/service.py: `sample` does). Names are
`encoder_cache_*`, `encoder_shm_*` and `encoder_peer_*`; sizes are in bytes; counters end in `_total`. A
stats key without a row below is still exported, as the gauge `encoder_cache_<key>` with a help that says
so, so a counter added to the store is never silently missing here; give it a row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class Stat:
    metric: str
    counter: bool  # else a gauge
    help: str
    labels: tuple[tuple[str, str], ...] = ()
    by: str = ""  # the stat is a dict: one sample per key, this label naming it


def _counter(metric: str, help: str, **labels: str) -> Stat:
    return Stat(metric, True, help, tuple(labels.items()))


def _gauge(metric: str, help: str) -> Stat:
    return Stat(metric, False, help)


_LOOKUPS = "Host LRU tier lookups, by result"
_DROPPED = ("Write-behinds to Redis dropped (the id's marker settled as not stored), by reason: backlog_full (the "
            "backlog at its bound: Redis away too long, or slower than the encodes), failed (writes paused after an "
            "OOM reply, the SET refused, or Redis gone during every try)")
_DROPPED_COPIES = ("Row copies not written to Redis, by reason (refused: Redis full or an error reply, or writes "
                   "paused by OOM; backlog_full): their locations are written all the same")
_REDIS_HITS = ("Redis tier reads that found a valid value, by what was read (entry: the whole value, rows: a "
               "chunk's rows by GETRANGE)")

# replicas.stats() key -> metric. The local tier's keys start with `local_`, Redis's with `redis_`, the peer
# row path's with `peer_` (PEERS).
STORE: dict[str, Stat] = {
    # what this replica holds, kept known in Redis (replicas/announce.py)
    "reshared": _counter("encoder_cache_reshared",
                         "Entries an encode found in the host LRU tier after Redis had evicted them: written to "
                         "Redis again, so that other replicas can fetch them"),
    "bindings_lost": _counter("encoder_cache_bindings_lost",
                              "Caller ids dropped here because Redis lost their binding and another replica "
                              "bound them to other bytes meanwhile"),
    # host LRU tier and leases (cache/local.py)
    "local_hits": _counter("encoder_cache_local_lookups", _LOOKUPS, result="hit"),
    "local_misses": _counter("encoder_cache_local_lookups", _LOOKUPS, result="miss"),
    "local_inserts": _counter("encoder_cache_local_inserts", "Entries put in the host LRU tier"),
    "local_evictions": _counter("encoder_cache_local_evictions",
                                "Entries evicted from the host LRU tier to make room (pinned ones never are)"),
    "local_too_big": _counter("encoder_cache_local_too_big",
                              "Entries not cached because they are larger than the whole tier (--cache-bytes)"),
    "local_lease_expired": _counter("encoder_cache_lease_expiries",
                                    "Pins (leases) ended by their deadline (--lease-s) rather than by a release "
                                    "or a full fetch"),
    "local_fetch_ended": _counter("encoder_cache_pins_ended_by_fetch",
                                  "Pin holders ended because fetches delivered every row of their id"),
    "local_pin_refused": _counter("encoder_cache_pin_refusals",
                                  "Pins refused at --max-pinned-bytes (429; 400 when the request's pins could "
                                  "never fit)"),
    "local_entries": _gauge("encoder_cache_local_entries", "Entries in the host LRU tier, pinned or not"),
    "local_used_bytes": _gauge("encoder_cache_local_used_bytes", "Bytes of the entries in the host LRU tier"),
    "local_capacity_bytes": _gauge("encoder_cache_local_capacity_bytes", "Size of the host LRU tier (--cache-bytes)"),
    "local_pinned_keys": _gauge("encoder_cache_pinned_ids", "Ids pinned (leased): their entry present or encoding"),
    "local_ended_keys": _gauge("encoder_cache_fetch_ended_ids",
                               "Ids whose pin holders a full fetch ended, remembered for their clients' releases"),
    "local_pinned_bytes": _gauge("encoder_cache_pinned_bytes",
                                 "Bytes pinned: entries, and reservations for the rows still encoding"),
    "local_max_pinned_bytes": _gauge("encoder_cache_max_pinned_bytes", "Bound on pinned bytes (--max-pinned-bytes)"),
    # Redis tier (replicas/redis_tier.py); absent without --redis-url
    "redis_state": _gauge("encoder_cache_redis_up",
                          "1 while the Redis tier is up, 0 while it is down or failing over (reads miss at once, "
                          "writes wait in the backlog, a background probe reconnects)"),
    "redis_writes_paused": _gauge("encoder_cache_redis_writes_paused",
                                  "1 while writes to Redis pause after an OOM reply (cool-down), else 0"),
    "redis_queued_bytes": _gauge("encoder_cache_redis_write_queue_bytes",
                                 "Bytes of entries queued for the write-behind to Redis (the backlog: it grows "
                                 "while Redis is away, up to its bound)"),
    "redis_hits": _counter("encoder_cache_redis_hits", _REDIS_HITS, read="entry"),
    "redis_range_hits": _counter("encoder_cache_redis_hits", _REDIS_HITS, read="rows"),
    "redis_misses": _counter("encoder_cache_redis_misses", "Redis tier reads of a key that is not there"),
    "redis_corrupt": _counter("encoder_cache_redis_corrupt_values",
                              "Redis values short, corrupt or of another format (read as misses)"),
    "redis_errors": _counter("encoder_cache_redis_errors", "Redis commands that failed"),
    "redis_down_events": _counter("encoder_cache_redis_down_events", "Times the Redis tier went down"),
    "redis_oom_events": _counter("encoder_cache_redis_oom_events",
                                 "OOM replies to writes (Redis full without an eviction policy): writes pause"),
    "redis_writes": _counter("encoder_cache_redis_writes",
                             "Locations of entries written behind to Redis (this replica holds their rows)"),
    "redis_located": _counter("encoder_cache_redis_located",
                              "Directory reads that found where an id's rows are (a replica, or a row copy)"),
    "redis_copies": _counter("encoder_cache_redis_row_copies",
                             "Row copies written to Redis (entries up to --redis-row-copy-bytes)"),
    "redis_copies_dropped": _counter("encoder_cache_redis_dropped_row_copies", _DROPPED_COPIES,
                                     reason="refused"),
    "redis_copies_dropped_full": _counter("encoder_cache_redis_dropped_row_copies", _DROPPED_COPIES,
                                          reason="backlog_full"),
    "redis_writes_dropped": _counter("encoder_cache_redis_dropped_writes", _DROPPED, reason="failed"),
    "redis_writes_dropped_full": _counter("encoder_cache_redis_dropped_writes", _DROPPED, reason="backlog_full"),
    "redis_writes_after_outage": _counter("encoder_cache_redis_backlog_writes",
                                          "Entries written to Redis after waiting in the backlog for it to come "
                                          "back"),
    "redis_skipped_down": _counter("encoder_cache_redis_skipped_while_down",
                                   "Redis reads answered as a miss at once because the tier was down"),
    # Redis connections (replicas/redis_connections.py)
    "redis_pool_waits": _counter("encoder_cache_redis_pool_waits",
                                 "Redis operations that waited for a free connection (all of them busy)"),
    "redis_pool_timeouts": _counter("encoder_cache_redis_pool_timeouts",
                                    "Redis operations that got no free connection in time (a miss or a dropped "
                                    "write; Redis is not marked down for it)"),
    "redis_retries": _counter("encoder_cache_redis_retries",
                              "Redis commands run again on a fresh connection after a connection error (pooled "
                              "connections dead after a Redis restart)"),
    # handoff of ids between replicas (replicas/directory.py, replicas/subscriber.py)
    "redis_pending_marked": _counter("encoder_cache_redis_pending_marked",
                                     "Ids this replica marked pending in Redis when it accepted them"),
    "redis_pending_elsewhere": _counter("encoder_cache_redis_claimed_elsewhere",
                                        "Images accepted here that another replica had claimed first: this one "
                                        "waited for its rows instead of encoding them too"),
    "redis_pending_orphaned": _counter("encoder_cache_redis_pending_orphaned",
                                       "Waits that found the replica encoding the id gone (its marker expired or "
                                       "released, the image bytes kept): the image is encoded here instead"),
    "redis_inputs_pushed_out": _counter("encoder_cache_redis_inputs_pushed_out",
                                        "Image bytes this replica kept in Redis deleted to make room for newer ones "
                                        "(its share of Redis for them is full): those images can no longer be "
                                        "encoded again elsewhere should this replica die"),
    "redis_inputs_skipped": _counter("encoder_cache_redis_inputs_skipped",
                                     "Accepted images whose bytes were not kept in Redis (this replica's kept "
                                     "bytes were at their bound): should it die before their rows land, no "
                                     "other replica can encode them in its place"),
    "redis_input_bytes": _gauge("encoder_cache_redis_input_bytes",
                                "Bytes of accepted images this replica keeps in Redis while it encodes them"),
    "redis_pending_settled": _counter("encoder_cache_redis_pending_settled",
                                      "Pending markers settled and published: rows landed, or the encode failed "
                                      "or its rows could not be stored"),
    "redis_pending_unsettled": _gauge("encoder_cache_redis_pending_unsettled",
                                      "Ids claimed by this replica and not settled yet (their markers renewed "
                                      "every heartbeat)"),
    "redis_queued_notices": _gauge("encoder_cache_redis_notice_queue",
                                   "Marker outcomes queued behind the write-behind, to be published"),
    "redis_notices_dropped": _counter("encoder_cache_redis_dropped_notices",
                                      "Marker outcomes not published (an error, or the queue bound): waiters "
                                      "elsewhere learn at the marker's expiry (seconds) and take the image over"),
    "redis_pending_waits": _counter("encoder_cache_redis_pending_waits",
                                    "Fetches that waited for an id another replica is encoding"),
    "redis_pending_wakeups": _counter("encoder_cache_redis_pending_wakeups",
                                      "Waiting fetches woken by the encoding replica's message"),
    "redis_pending_timeouts": _counter("encoder_cache_redis_pending_timeouts",
                                       "Waits for another replica's encode that reached the fetch's timeout"),
    "redis_pending_failures": _counter("encoder_cache_redis_pending_failures",
                                       "Waits answered with the encoding replica's failure (not a 404)"),
    "redis_pending_channels": _gauge("encoder_cache_redis_pending_channels",
                                     "Ids this replica's fetches wait on now (channels of its one pub/sub "
                                     "connection)"),
    "redis_subscriber_connects": _counter("encoder_cache_redis_subscriber_connects",
                                          "Connections of the shared pub/sub connection"),
    "redis_subscriber_lost": _counter("encoder_cache_redis_subscriber_lost",
                                      "Losses of the shared pub/sub connection (its waits end at once)"),
    "redis_restarts_seen": _counter("encoder_cache_redis_restarts_seen",
                                    "Redis restarts seen by the heartbeat (its run id changed): claims, leased "
                                    "ids and bindings written again"),
    "redis_bindings_checked": _counter("encoder_cache_redis_bindings_checked",
                                       "Caller ids bound (or found bound) to their content in Redis"),
    "redis_error_replies": Stat("encoder_cache_redis_error_replies", True,
                                "Error replies from Redis other than a lost connection or a failover (CROSSSLOT, "
                                "NOSCRIPT, WRONGTYPE, ...), by their code: logged as errors; the operation was a "
                                "miss or a dropped write", by="reason"),
    "redis_nodes": Stat("encoder_cache_redis_node_up", False,
                        "1 for each Redis primary (and a master's Sentinels) that answered the tier's last look, "
                        "0 for each that did not", by="node"),
}

# ShmWriter.stats() key -> metric (core/shm_writer.py); absent without --shm-fetch.
SHM: dict[str, Stat] = {
    "opens": _counter("encoder_shm_opens", "Client shared-memory files opened and mapped"),
    "evictions": _counter("encoder_shm_mapping_evictions", "Mappings closed to stay under the open-file bound"),
    "writes": _counter("encoder_shm_writes", "Fetches whose rows were written into a client's file"),
    "written_bytes": _counter("encoder_shm_written_bytes", "Bytes of rows written into clients' files"),
    "copy_seconds": _counter("encoder_shm_copy_seconds", "Time the copies into clients' files took (bytes / "
                             "this = the copy's rate)"),
    "open": _gauge("encoder_shm_open_mappings", "Client files mapped now"),
}


_PEER_FAILURES = ("Row fetches from another replica that failed over (to another replica, a row copy, or this "
                  "replica encoding the image), by reason: no_answer (no answer in time: frozen, hung, its packets "
                  "dropped), foreign_rows (rows that do not match the checksums the directory holds for them), "
                  "auth_mismatch (it refused this replica's signature: the replicas' --auth-token differ), other "
                  "(gone, or it no longer holds the rows)")

# replicas.stats() `peer_` key -> metric: Peers.stats() (replicas/peers.py); absent without --redis-url.
PEERS: dict[str, Stat] = {
    "peer_fetches": _counter("encoder_peer_fetches", "Row fetches from another replica that got their rows"),
    "peer_bytes": _counter("encoder_peer_bytes", "Bytes of rows fetched from other replicas"),
    "peer_failures": _counter("encoder_peer_failed_fetches",
                              "Row fetches from another replica that failed (any reason)"),
    "peer_no_answer": _counter("encoder_peer_failures", _PEER_FAILURES, reason="no_answer"),
    "peer_foreign": _counter("encoder_peer_failures", _PEER_FAILURES, reason="foreign_rows"),
    "peer_refused": _counter("encoder_peer_failures", _PEER_FAILURES, reason="auth_mismatch"),
    "peer_skipped": _counter("encoder_peer_skipped",
                        "Row fetches not sent to a replica that did not answer in time, or sent rows that were not "
                        "the directory's, moments before (failed over at once)"),
}


class CacheCollector(Collector):
    """Registered on the core's registry (core/metrics.py); `cache`: what has `stats()` (the replicas' face, or
    a store alone); `shm` is None when shared-memory fetch is off."""

    def __init__(self, cache, shm=None):
        self._cache, self._shm = cache, shm

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        _add(families, STORE | PEERS, self._cache.stats(), "encoder_cache_")
        if self._shm is not None:
            _add(families, SHM, self._shm.stats(), "encoder_shm_")
        yield from families.values()


def _add(families: dict[str, Metric], table: dict[str, Stat], stats: dict, prefix: str) -> None:
    for key, value in stats.items():
        if key == "redis_state":
            value = value == "up"
        stat = table.get(key)
        if stat is not None and stat.by and isinstance(value, dict):
            for label, one in value.items():
                _family(families, stat, (stat.by,)).add_metric([str(label)], float(one))
            continue
        if not isinstance(value, (int, float)):  # bools are ints
            continue
        stat = stat or _gauge(prefix + key, f"stats() key {key!r} (not described in core/cache_metrics.py)")
        _family(families, stat, tuple(name for name, _ in stat.labels)).add_metric([v for _, v in stat.labels],
                                                                                   float(value))


def _family(families: dict[str, Metric], stat: Stat, labels: tuple[str, ...]) -> Metric:
    family = families.get(stat.metric)
    if family is None:
        kind = CounterMetricFamily if stat.counter else GaugeMetricFamily
        family = families[stat.metric] = kind(stat.metric, stat.help, labels=list(labels))
    return family
