"""This replica's claims in Redis (replicas/directory.py): the ids it accepted and encodes (or whose rows it
writes), each a pending marker it renews until the outcome settles it, with the image bytes beside it.

    claims = Claims(connections, owner, pending_ttl_s=4, max_claims=65536, max_input_bytes=256 << 20)
    async with claims.lock:
        new = claims.add(keys, lease_s, tags, inputs)       # recorded here (kept while Redis is away)
        elsewhere = await claims.write(new, lease_s, epoch)  # SET NX: the names another replica holds
    await claims.beat(epoch, writable)                      # the heartbeat: renew, or write again
    await claims.settle(key, value, claim, failure_ttl_s)   # landed, failed or released: state, then message
    await claims.withdraw(key)                              # the id names other rows: no claim, no input

The tier owns one (redis_link.py), runs its heartbeat (redis_tier.py), and answers the Redis errors these
raise. Bounded: at most `max_claims` ids (past it the oldest is no longer renewed: its marker expires by
itself), each claim until its lease ends at the latest. Image bytes stay in Redis for their lease, after the
rows land too (so that another replica can encode the image again should this one die); this replica keeps at
most `input_budget` bytes of them there at a time (`max_input_bytes`, a quarter of Redis's maxmemory when that
is smaller): past it the oldest it kept are deleted to make room (but not the newer bytes of a key claimed
again), the newest images (those most likely not yet fetched) always kept. On a Redis that never evicts
(noeviction) an image's bytes are kept only while Redis is under half full as last read (`redis_memory`):
else, and when Redis refuses them, not kept (counted); the markers and the directory always come first.
`epoch` is the tier's count of recoveries: a claim last written in an earlier one (or never: Redis was away
when it was made) is written again, input included, by the next beat.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from redis.exceptions import OutOfMemoryError

from encoder_service.replicas.directory import (
    LANDED, RELEASED, input_name, is_pending, marker_name, pending_owner, pending_value,
)  # fmt: skip
from encoder_service.replicas.redis_connections import Connections


_REWRITE_BATCH = 64  # kept inputs written again per round trip after an outage (up to the input budget in all)


@dataclass(eq=False)
class Claim:
    value: bytes  # the marker's value: pending <tag> <owner>
    input: bytes | None  # the image's bytes, kept beside the marker (None: not kept)
    until: float  # time.monotonic(): the encode's lease ends, and with it the renewals
    epoch: int = -1  # the tier's epoch the marker was last written in (-1: never)


class Claims:
    def __init__(self, conns: Connections, owner: str, *, pending_ttl_s: float, max_claims: int,
                 max_input_bytes: int):
        self._conns, self.owner = conns, owner
        self._px = int(pending_ttl_s * 1000)
        self._max_claims, self._max_input_bytes = max_claims, max_input_bytes
        self._claims: OrderedDict[str, Claim] = OrderedDict()
        # Inputs sent, oldest first: (until, key, the bytes: kept here too, to write again into a Redis that lost
        # them), and how many of them each key has (a key claimed again has a newer input under the same name);
        # those the budget pushes out, to DEL with the next write (at most max_claims of them: past it the
        # oldest are left to their lease).
        self._kept: collections.deque[tuple[float, str, bytes]] = collections.deque()
        self._kept_keys: collections.Counter[str] = collections.Counter()
        self._to_delete: collections.deque[str] = collections.deque(maxlen=max_claims)
        self._kept_bytes = 0
        self._kept_epoch = 0  # the tier's epoch the kept inputs were last all written in
        self._redis_maxmemory = 0  # 0: unknown, or no limit
        self._headroom: int | None = None  # bytes inputs may still take on a Redis that never evicts
        self.inputs_skipped = 0
        self.inputs_pushed_out = 0  # deleted to make room for newer ones
        self.lock = asyncio.Lock()  # a beat never interleaves with a claim's NX or a settle

    def __len__(self) -> int:
        return len(self._claims)

    def __iter__(self):
        return iter(self._claims)

    def get(self, key: str) -> Claim | None:
        return self._claims.get(key)

    def add(self, keys: Iterable[str], lease_s: float, tags: Mapping[str, int], inputs: Mapping[str, bytes]
            ) -> dict[str, Claim]:
        """Record a claim of each of `keys` (replacing an older one of the same key), for `lease_s` at most,
        with its content tag and, while under the bound, its image bytes."""
        until = time.monotonic() + lease_s
        added = {}
        for key in dict.fromkeys(keys):
            data = inputs.get(key)
            if data is not None:
                if len(data) > self.input_budget or (self._headroom is not None and len(data) > self._headroom):
                    self.inputs_skipped += 1
                    data = None
                else:
                    while self.input_bytes + len(data) > self.input_budget:  # the oldest make room
                        old = self._pop_kept()
                        if old is not None:  # (a key claimed again keeps its newer input: no DEL)
                            self._to_delete.append(old)
                        self.inputs_pushed_out += 1
                    self._kept.append((until, key, data))
                    self._kept_keys[key] += 1
                    self._kept_bytes += len(data)
                    if self._headroom is not None:
                        self._headroom -= len(data)
            self.drop(key)
            self._claims[key] = added[key] = Claim(pending_value(tags.get(key, 0), self.owner), data, until)
        while len(self._claims) > self._max_claims:
            self.drop(next(iter(self._claims)))
        return added

    def drop(self, key: str, claim: Claim | None = None) -> None:
        """No longer renew `key`'s claim (only if it is `claim`, when given)."""
        current = self._claims.get(key)
        if current is not None and (claim is None or current is claim):
            del self._claims[key]

    def redis_memory(self, maxmemory: int, used: int, evicts: bool) -> None:
        """Redis's memory as its INFO says (maxmemory 0: no limit): a quarter of maxmemory bounds the inputs
        kept there; on a Redis that never `evicts`, inputs take only what keeps it under half full."""
        self._redis_maxmemory = maxmemory
        self._headroom = max(0, maxmemory // 2 - used) if maxmemory and not evicts else None

    @property
    def input_budget(self) -> int:
        if self._redis_maxmemory:
            return min(self._max_input_bytes, self._redis_maxmemory // 4)
        return self._max_input_bytes

    @property
    def input_bytes(self) -> int:
        """Bytes of the inputs this replica sent to Redis whose lease has not ended."""
        now = time.monotonic()
        while self._kept and self._kept[0][0] <= now:
            self._pop_kept()
        return self._kept_bytes

    def _pop_kept(self) -> str | None:
        """The oldest kept input leaves the books: its key, or None while a newer input of that key is kept."""
        _, key, data = self._kept.popleft()
        self._kept_bytes -= len(data)
        self._kept_keys[key] -= 1
        if self._kept_keys[key]:
            return None
        del self._kept_keys[key]
        return key

    async def write(self, claims: dict[str, Claim], lease_s: float, epoch: int) -> list[str]:
        """Write the claims' inputs and markers (SET NX: one round trip); a marker found set is another
        replica's (it encodes that id: its claim is dropped here) or not live (a failure, one of ours from
        before: replaced, a second round trip). An input Redis refuses (full) is an input not kept, never a
        reason to stop: its marker is written all the same. Returns the names another replica holds. Raises
        what Redis raised for a marker. Hold `lock`."""
        lease_px = max(1, int(lease_s * 1000))
        deleting = list(self._to_delete)  # inputs the budget pushed out (best effort)
        self._to_delete.clear()
        # One DEL per name: in a Redis Cluster the names of different ids live in different slots.
        commands, marker_at, input_at = [("delete", input_name(key)) for key in deleting], [], {}
        for key, claim in claims.items():
            if claim.input is not None:  # first: a marker anyone sees has its input beside it
                input_at[key] = len(commands)
                commands.append(("set", input_name(key), claim.input, lease_px))
            marker_at.append(len(commands))
            commands.append(("set", marker_name(key), claim.value, self._px, True))
        replies = await self._conns.pipelined(*commands, raise_on_error=False)
        for at in marker_at:
            if isinstance(replies[at], Exception):
                raise replies[at]
        for key, at in input_at.items():
            if isinstance(replies[at], Exception):  # not kept (Redis full); still counted until its lease ends
                self.inputs_skipped += 1
                claims[key].input = None
        taken = [key for key, at in zip(claims, marker_at) if not replies[at]]
        elsewhere, replace, again = [], [], []
        if taken:
            for key, value in zip(taken, await self._conns.pipelined(*(("get", marker_name(k)) for k in taken))):
                live = is_pending(value) and pending_owner(value) != self.owner
                # Gone between the NX and the GET (its owner settled it): claimed with NX again, not replaced,
                # so that a replica claiming it meanwhile keeps it.
                (elsewhere if live else again if value is None else replace).append(key)
        if replace or again:
            replies = await self._conns.pipelined(
                *(("set", marker_name(k), claims[k].value, self._px) for k in replace),
                *(("set", marker_name(k), claims[k].value, self._px, True) for k in again))
            elsewhere += [k for k, ok in zip(again, replies[len(replace):]) if not ok]
        for key, claim in claims.items():
            claim.epoch = epoch
            if key in elsewhere:  # its owner renews that marker, not us
                self.drop(key, claim)
        return elsewhere

    async def beat(self, epoch: int, writable: bool) -> None:
        """Renew every claim's marker (PEXPIRE, which a full Redis does not refuse); write again, when
        `writable`, those Redis lost (an outage, a restart, an eviction) or never had, and after an outage or a
        failover the kept inputs of settled claims still in their lease (a Redis that lost them could not have
        another replica encode those images again, should this one die). Claims past their lease are dropped
        first."""
        now = time.monotonic()
        for key in [k for k, c in self._claims.items() if c.until <= now]:
            self.drop(key)
        if writable and epoch != self._kept_epoch:
            await self._write_kept_inputs(now)
            self._kept_epoch = epoch
        async with self.lock:
            claims = list(self._claims.items())
            if not claims:
                return
            renewed = await self._conns.pipelined(*(("pexpire", marker_name(k), self._px) for k, _ in claims))
            lost = [(k, c) for (k, c), ok in zip(claims, renewed) if not ok or c.epoch != epoch]
            if not lost or not writable:
                return
            commands = []
            for key, claim in lost:
                if claim.input is not None and claim.epoch != epoch:  # Redis may be a new (empty) one
                    commands.append(("set", input_name(key), claim.input, max(1, int((claim.until - now) * 1000))))
                commands.append(("set", marker_name(key), claim.value, self._px))
            await self._conns.pipelined(*commands)
            for _, claim in lost:
                claim.epoch = epoch

    async def _write_kept_inputs(self, now: float) -> None:
        """SET again the kept inputs whose lease runs on (those of live claims that carry their own: by the claims'
        rewrite), newest last, a bounded batch per round trip."""
        latest = {key: (until, data) for until, key, data in self._kept
                  if until > now and getattr(self._claims.get(key), "input", None) is None}
        commands = [("set", input_name(key), data, max(1, int((until - now) * 1000)))
                    for key, (until, data) in latest.items()]
        for at in range(0, len(commands), _REWRITE_BATCH):
            await self._conns.pipelined(*commands[at:at + _REWRITE_BATCH])

    async def settle(self, key: str, value: bytes, claim: Claim | None, failure_ttl_s: float) -> bool:
        """Publish `key`'s outcome, state first, then the message (a waiter subscribed before the PUBLISH gets
        the message, one subscribed after it sees the new state when it checks again): LANDED (DEL marker and
        input), RELEASED (DEL marker, the input stays for whoever takes it over), or a failure (SET marker to
        it for `failure_ttl_s`, DEL input; under OOM, where SET is refused, DEL the marker). A failure or
        release of `claim` that a newer claim replaced (the id accepted here again since) is not published:
        False. Raises what Redis raised (OutOfMemoryError: after deleting the marker)."""
        current = self._claims.get(key)
        if value != LANDED and current is not None and current is not claim:
            return False
        marker = marker_name(key)
        async with self.lock:  # no beat renews the marker between these commands and the drop
            if value == LANDED:  # the input stays for its lease: should the owner die, another replica encodes it
                await self._conns.pipelined(("delete", marker), ("publish", marker, value))
            elif value == RELEASED:
                await self._conns.pipelined(("delete", marker), ("publish", marker, value))
            else:
                replies = await self._conns.pipelined(
                    ("set", marker, value, int(failure_ttl_s * 1000)), ("delete", input_name(key)),
                    ("publish", marker, value), raise_on_error=False)
                if isinstance(replies[0], OutOfMemoryError):
                    await self._conns.run("delete", marker)
                    self.drop(key, claim)
                    raise replies[0]
            self.drop(key, None if value == LANDED else claim)
        return True

    async def withdraw(self, key: str) -> None:
        """This replica's claim of `key` was made for bytes the id does not name (its rows elsewhere are of
        other content): DEL the marker and the input (neither is to be waited on or encoded under the id),
        then PUBLISH LANDED (waiters read the rows that exist). Nothing when the claim is not ours (another
        replica's marker stays). Raises what Redis raised."""
        async with self.lock:
            if self._claims.pop(key, None) is None:
                return
            marker = marker_name(key)
            await self._conns.pipelined(("delete", marker), ("delete", input_name(key)), ("publish", marker, LANDED))
