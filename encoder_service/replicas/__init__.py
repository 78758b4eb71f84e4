"""What replicas share and how, behind one face (face.py: `Replicas`) in two forms: `Solo` (solo.py: one
replica, no Redis) and `Shared` (shared.py): the Redis tier (redis_tier.py: directory reads, the
write-behind, claims and waits, bindings; its health, redis_health.py; the connection kinds, standalone,
Cluster or Sentinel, redis_connections.py), the handoff of ids between replicas (directory.py, claims.py,
bindings.py, subscriber.py), what this replica holds kept known there (announce.py), and the row path
between replicas (peers.py). What this process holds is cache/'s."""

from collections.abc import Callable

from encoder_service.cache import EmbeddingStore
from encoder_service.replicas.directory import EncodeFailed, Located, Marked, Settled
from encoder_service.replicas.face import GroupClaim, Replicas, TakeOver
from encoder_service.replicas.peers import Peers
from encoder_service.replicas.redis_tier import RedisOptions, RedisTier
from encoder_service.replicas.shared import Shared
from encoder_service.replicas.solo import Solo


def form(store: EmbeddingStore, redis: RedisTier | None, peers: Peers, *, layout: str,
         on_unmarked: Callable[[int], None]) -> Replicas:
    """The face over `store`: `Solo` without a Redis tier, else `Shared` over it (`peers`: the row path to the
    other replicas, `layout` their rows', `on_unmarked(n)`: n ids accepted could not be claimed)."""
    if redis is None:
        return Solo(store)
    return Shared(store, redis, peers, layout=layout, on_unmarked=on_unmarked)


__all__ = [
    "EncodeFailed", "GroupClaim", "Located", "Marked", "Peers", "RedisOptions", "RedisTier", "Replicas", "Settled",
    "Shared", "Solo", "TakeOver", "form",
]  # fmt: skip
