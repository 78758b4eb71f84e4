"""The Redis tier's claims and waits (redis_tier.py; directory.py has the protocol): `mark_pending` claims the
ids an encode accepted (SET NX, the image bytes beside the markers: claims.py), `wait_for` is a fetch's (or a
waiting flight's) wait on another replica's encode, woken through one shared pub/sub connection
(subscriber.py). For `recovery_grace_s` after Redis came back, an id with no marker is "unavailable", not
"unknown" (other replicas may not have written theirs again yet)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from redis.exceptions import RedisError

from encoder_service.replicas import directory
from encoder_service.replicas.directory import (
    RELEASED, EncodeFailed, Marked, Settled, input_name, is_pending, marker_name,
)  # fmt: skip
from encoder_service.replicas.redis_connections import PoolTimeout, timeout_at
from encoder_service.replicas.redis_link import RedisLink
from encoder_service.replicas.redis_reads import DirectoryReads
from encoder_service.replicas.subscriber import SubscriberLost


class Pending:
    def __init__(self, link: RedisLink, reads: DirectoryReads):
        self._link, self._reads, self.counters = link, reads, link.counters
        self._conns, self.health, self._claims = link.conns, link.health, link.claims

    async def mark_pending(self, keys: Sequence[str], lease_s: float, tags: Mapping[str, int] | None = None,
                           inputs: Mapping[str, bytes] | None = None) -> Marked:
        """Claim `keys` (accepted here, to be encoded here) for at most `lease_s` (the encode's lease): SET NX
        of each marker, carrying its content tag from `tags` (a caller id's bytes), with the image bytes
        from `inputs` beside it (claims.py: bounded). One round trip; a second for markers found set
        (another replica's: it encodes that id, `Marked.elsewhere`; a failure or an old one of ours:
        replaced). The heartbeat renews the claims until they settle. Not `ok` while down or paused by OOM,
        or on an error: the claims are kept and their markers written once Redis takes them again."""
        async with self._claims.lock:  # a beat must not write one of these claims before its NX here
            claims = self._claims.add(keys, lease_s, tags or {}, inputs or {})
            if not claims or self.health.not_writing() is not None:
                return Marked(False)
            elsewhere = await self._link.or_none(self._claims.write(claims, lease_s, self.health.epoch), writing=True)
            if elsewhere is None:
                return Marked(False)
        self.counters["pending_marked"] += len(claims) - len(elsewhere)
        self.counters["pending_elsewhere"] += len(elsewhere)
        return Marked(True, frozenset(elsewhere))

    async def wait_for(self, key: str, timeout_s: float | None, label: str | None = None) -> Settled:
        """A wait for `key` (a miss here) that another replica may be encoding. LANDED as soon as its rows are
        in Redis (read them now); ORPHANED once its marker is gone (expired: its owner stopped renewing it;
        or released) while its input is still there (encode it here); NOT_PENDING at once when there is
        neither; TIMED_OUT after `timeout_s` (None: no bound; 0: the state now, without waiting: TIMED_OUT
        for an id still pending); UNAVAILABLE when Redis is or goes down, or came back within
        `recovery_grace_s` and has no marker for it (at once, no hang). Raises `EncodeFailed` with the
        encoding replica's error. `label` names the id in error messages (default: `key`)."""
        if not self.health.available():
            return Settled.UNAVAILABLE
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        try:
            async with timeout_at(deadline if timeout_s else None):  # 0: "don't wait", after one check
                settled = await self._wait(key, label or key, deadline)
        except TimeoutError:
            self.counters["pending_timeouts"] += 1
            return Settled.TIMED_OUT
        except EncodeFailed:
            self.counters["pending_failures"] += 1
            raise
        except (SubscriberLost, PoolTimeout):
            return Settled.UNAVAILABLE
        except RedisError as exc:
            self.health.on_error(exc)
            return Settled.UNAVAILABLE
        if settled is Settled.NOT_PENDING and await self._cannot_tell(key):
            return Settled.UNAVAILABLE  # its owner may not have written its marker (again) yet
        self._reads.drop_location(key)  # landed (or being taken over) since it was last read: read it afresh
        self.counters["pending_orphaned"] += settled is Settled.ORPHANED
        return settled

    async def _cannot_tell(self, key: str) -> bool:
        try:
            return await self.health.cannot_tell(key)
        except (RedisError, PoolTimeout):
            return True  # not a 404 either

    async def _wait(self, key: str, label: str, deadline: float | None) -> Settled:
        marker = marker_name(key)
        settled, _ = await self._check(key, marker, label)
        if settled is not None:
            return settled
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise TimeoutError  # pending, and no time left to wait
        async with self._link.subscriber.subscription(marker) as message:
            slept = False
            while True:
                # Subscribed (Redis confirmed it): check again. An outcome published between the first check
                # and the SUBSCRIBE is visible as state now (the publisher changes the state first); any
                # later one arrives as a message. The wait ends at the marker's expiry at the latest: then
                # the state is checked again (a live owner has renewed the marker; a dead one has not).
                settled, expires_at = await self._check(key, marker, label)
                if settled is not None:
                    return settled
                if not slept:
                    self.counters["pending_waits"] += 1
                    slept = True
                # Bounded by the caller's deadline here too, not only by the cancellation `wait_for`'s
                # timeout sends: on Python 3.11 asyncio.wait_for (inside redis-py) can swallow one.
                wake_at = min((t for t in (expires_at, deadline) if t is not None), default=None)
                try:
                    async with timeout_at(wake_at):
                        value = await asyncio.shield(message)
                    break
                except TimeoutError:
                    if wake_at == deadline:
                        raise
        if value is None:
            raise SubscriberLost("redis pub/sub connection lost during the wait")
        self.counters["pending_wakeups"] += 1
        if value == RELEASED:  # its owner gave it up: whoever claims it first encodes it
            return Settled.ORPHANED
        directory.raise_if_failed(value, label)
        return Settled.LANDED

    async def _check(self, key: str, marker: str, label: str) -> tuple[Settled | None, float | None]:
        """(LANDED, ORPHANED or NOT_PENDING, None) or raises the failure; (None, when the marker expires, in
        loop time) while still pending. LANDED: a location or a row copy, and no claim (a claim beside a
        location is an encode again, its owner gone: the rows it lands are the ones to read)."""
        exists, value, pttl, input_len = await self._conns.pipelined(
            ("exists", directory.location_name(key), key), ("get", marker), ("pttl", marker),
            ("strlen", input_name(key)))
        if is_pending(value):  # claimed: even beside a location (of a replica gone: being encoded again)
            # Wake 20 ms past the expiry, so that the next check finds it gone; -2: it expired between the GET
            # and the PTTL (check again now); -1: no TTL (not one of ours).
            now = asyncio.get_running_loop().time()
            return None, (now + (pttl + 20) / 1000 if pttl >= 0 else now if pttl == -2 else None)
        if exists:
            return Settled.LANDED, None
        directory.raise_if_failed(value, label)
        return (Settled.ORPHANED if input_len else Settled.NOT_PENDING), None
