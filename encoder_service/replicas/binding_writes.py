"""The Redis tier's writes of caller ids' bindings (redis_tier.py; bindings.py has the script and what its
answers mean): `bind_tags` binds caller ids to one content each, first come first served across replicas;
`withdraw` takes back a claim the rows found elsewhere contradict; `retire` retires ids that name two
contents."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from redis.exceptions import OutOfMemoryError, RedisError

from encoder_service.errors import Unavailable
from encoder_service.replicas import bindings, directory
from encoder_service.replicas.directory import marker_name
from encoder_service.replicas.redis_connections import PoolTimeout
from encoder_service.replicas.redis_health import UNREACHABLE, error_reason
from encoder_service.replicas.redis_link import RedisLink


class Bindings:
    def __init__(self, link: RedisLink):
        self._link, self.counters = link, link.counters
        self._conns, self.health, self._claims = link.conns, link.health, link.claims

    async def bind_tags(self, tags: Mapping[str, int], *, again: bool = False) -> dict[str, int]:
        """Bind caller ids to one content each, first come first served across replicas (bindings.py: one
        script per id, which also reads the content tag the id's location or pending marker carries, where
        Redis lost the binding itself). Returns by name the tag each id is bound to now: this one, another
        replica's (a Conflict for the caller), or bindings.RETIRED. One round trip. {} while down or on an
        error: nobody here can tell, and the encode goes on as without Redis (the bindings of what it accepts
        are written again once Redis is back, `again`).
        Within `recovery_grace_s` of Redis coming back, or on a Redis node this replica has not seen yet (it
        restarted since the heartbeat last looked), the replicas holding ids may not have written their
        bindings again yet: an id Redis knows nothing of is not bound then (Unavailable: retry), unless
        `again` (this replica writing again the bindings of ids it holds)."""
        if not tags or not self.health.available():
            return {}
        known = self.health.known_nodes()
        commands = [bindings.bind_command(directory.binding_name(name), directory.location_name(name),
                                          marker_name(name), tag=tag, ttl_px=self._link.ttl_px, again=again,
                                          known_nodes=known)
                    for name, tag in tags.items()]
        try:
            replies = await self._conns.pipelined(*commands, raise_on_error=False)
        except PoolTimeout:
            return {}
        except RedisError as exc:
            self._failed(exc, again)
            return {}
        bound = {}
        for name, reply in zip(tags, replies):
            if isinstance(reply, RedisError):  # OOM on the SET: that id stays unbound (can't tell)
                self._failed(reply, again)
                continue
            tag = bindings.parse_bound(reply)
            if tag is bindings.RECOVERING:
                self.health.wake.set()  # a node new to this replica: look at Redis now
                raise Unavailable("the shared Redis tier came back moments ago, and the replicas holding caller "
                                  "ids have not written them again yet: retry")
            bound[name] = tag
        self.counters["bindings_checked"] += len(tags)
        return bound

    def _failed(self, exc: RedisError, again: bool) -> None:
        """A binding Redis did not make: noted in its health; down or full, the encode goes on unbound (as
        without Redis); any other error (a slot moving between masters: TRYAGAIN until redis-py gives up, "TTL";
        CROSSSLOT, NOSCRIPT, ...) is no answer either way while Redis is up for every other id: Unavailable
        for an encode. Writing again (`again`: the announcer's round), that id is left for its next round."""
        self.health.on_error(exc, writing=True)
        if not again and not isinstance(exc, (*UNREACHABLE, OutOfMemoryError)):
            raise Unavailable(f"the shared Redis tier could not bind a caller id now ({error_reason(exc)}: e.g. "
                              f"its slot is moving between Redis masters): retry") from None

    async def withdraw(self, key: str, tag: int) -> None:
        """An encode of caller id `key` found the id's rows elsewhere of content `tag`, not its own: its claim
        and kept bytes go (claims.py: withdraw), and the id's binding names `tag`, the rows that exist (the
        binding it passed was made before Redis knew of them). Best effort: Redis faults are the tier's."""
        await self._link.or_none(self._claims.withdraw(key), writing=True)
        await self._link.or_none(self._conns.pipelined(
            ("set", directory.binding_name(key), directory.binding_value(tag), self._link.ttl_px)), writing=True)

    async def retire(self, names: Sequence[str]) -> None:
        """Retire caller ids that name two contents on two replicas (bindings.py: Redis lost everything about
        them while one replica held them, then another accepted other bytes under them): their bindings say
        so for `ttl_s` and their locations go, so that no replica serves either content under them once it
        drops its own (every holder does at its next binding check). One round trip; best effort."""
        commands = [cmd for name in names for cmd in (
            ("set", directory.binding_name(name), bindings.RETIRED_VALUE, self._link.ttl_px),
            ("delete", directory.location_name(name)))]
        if commands:
            await self._link.or_none(self._conns.pipelined(*commands), writing=True)
