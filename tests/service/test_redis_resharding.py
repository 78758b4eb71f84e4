"""A Redis Cluster moving a slot from one master to another (resharding: `redis-cli --cluster reshard`), on real
redis-servers in cluster mode.

While a slot migrates, a command on keys of one id of which the source master holds some and not others gets
TRYAGAIN. That is not Redis being down (every other slot answers), and it is no answer for a caller id's binding:
the id's encode is 503 (retry) until the slot has moved, never admitted unbound (another replica could bind the
id to other bytes meanwhile), and the rest of the tier stays up."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from encoder_service.cache.keys import caller_key
from encoder_service.errors import Unavailable
from encoder_service.replicas.directory import binding_name, input_name, location_name, marker_name
from tests.support.redis_cluster import RedisClusterSet
from tests.support.stores import make_entry, open_store

FP = "0123456789abcdef01234567"


@pytest.fixture
def two_masters():
    redis_set = RedisClusterSet(masters=2, replicas=0).start()
    yield redis_set
    redis_set.stop()


def _owner_and_other(cluster: RedisClusterSet, slot: int):
    """(the master serving `slot`, the other one)."""
    with cluster.masters[0].client() as client:
        port = next(int(nodes[0][1]) for start, end, *nodes in client.execute_command("CLUSTER SLOTS")
                    if start <= slot <= end)
    source = next(n for n in cluster.masters if n.port == port)
    return source, next(n for n in cluster.masters if n is not source)


async def test_an_id_whose_slot_is_moving_is_503_until_it_has_moved_and_the_tier_stays_up(two_masters):
    store = await open_store(two_masters.url)
    try:
        entry = make_entry(1)
        key, other = caller_key("moving", FP), caller_key("staying", FP)
        tag = entry.header.content_tag or 7
        assert await store.bind_tags({key: tag}) == {key.name: tag}
        store.put(key.name, entry)
        await store.redis.flush()

        slot = key_slot(binding_name(key.name).encode())
        names = [binding_name(key.name), location_name(key.name), marker_name(key.name), input_name(key.name)]
        assert {key_slot(n.encode()) for n in names} == {slot}  # one id, one slot (its hash tag)
        source, target = _owner_and_other(two_masters, slot)
        with source.client() as src, target.client() as dst:
            source_id, target_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
            present = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
            assert {binding_name(key.name), location_name(key.name)} <= set(present)  # some of its keys here,
            assert marker_name(key.name) not in present  # not all (its script reads the marker too): TRYAGAIN

            with pytest.raises(Unavailable, match="moving"):
                await store.bind_tags({key: tag})  # before: answered {} and the encode went on unbound
            # The announcer writing its ids' bindings again leaves this one for its next round, not raising.
            assert await store.redis.bindings.bind_tags({key.name: tag}, again=True) == {}
            assert store.redis.state == "up"  # a slot moving is not Redis down: other ids bind as ever
            assert await store.bind_tags({other: 9}) == {other.name: 9}

            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *present)
            for client in (dst, src):
                client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        assert await store.bind_tags({key: tag}) == {key.name: tag}  # moved: the same binding, on its new master
        assert await store.bind_tags({key: tag + 1}) == {key.name: tag}  # other bytes still a Conflict
    finally:
        await store.close()
