"""The pub/sub connections of a Redis tier, shared by every wait (directory.py): bounded however many fetches
wait, and one message wakes every waiter of its channel.

    async with subscriber.subscription(channel) as message:   # returns once Redis confirmed the subscription
        ...check the state...                                  # nothing published from here on is missed
        data = await message                                   # bytes, or None when the connection was lost

Plain pub/sub (one server, a Sentinel's master, a Cluster on Redis < 7): one connection, SUBSCRIBE; a Cluster
broadcasts every PUBLISH to every node over its bus, so one node is enough. Sharded pub/sub (a Cluster on Redis
>= 7: redis_connections.py publishes with SPUBLISH then): a channel lives on the master of its slot (a marker's
channel is the marker's name: the id's hash tag), so there is one connection per master, SSUBSCRIBE, and no
message crosses the cluster bus.

Each connection (`_Link`) keeps a local entry per waited channel counting its waiters: the first subscribes,
the last to leave unsubscribes. A dispatcher task reads the connection and resolves the waiters' futures. Redis
answers each subscribe with one confirmation, in order, so a FIFO of futures per channel pairs replies with the
commands (an unsubscribe in between answers with its own kind, which is not queued).

Losing a connection (Redis killed, a master lost, or the tier marked down: `reset`) resolves its futures at once
with "lost" (None / False: results, not exceptions, so futures nobody awaits any more log nothing) and drops its
local state; the next wait connects again. A connection has no read timeout (it idles between messages; TCP
keepalive instead), and its connect and sends are shielded: a waiter that times out must not abort a command
half written on a shared connection (redis-py would close it under everyone). Sends go out in the order they
were made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from encoder_service.replicas import background

log = logging.getLogger("encoder_service.replicas.redis")


class SubscriberLost(Exception):
    """The pub/sub connection went away (or could not be used) during a wait."""


class _Channel:
    __slots__ = ("confirmed", "waiters")

    def __init__(self, confirmed: asyncio.Future):
        self.confirmed = confirmed  # True once Redis confirmed our SUBSCRIBE, False when lost first
        self.waiters: set[asyncio.Future] = set()  # each resolves with the next message, None when lost


@dataclass(frozen=True)
class _Kind:
    subscribe: bytes
    unsubscribe: bytes
    message: bytes  # a published message's reply kind
    confirmed: bytes  # a subscribe's reply kind


PLAIN = _Kind(b"SUBSCRIBE", b"UNSUBSCRIBE", b"message", b"subscribe")
SHARDED = _Kind(b"SSUBSCRIBE", b"SUNSUBSCRIBE", b"smessage", b"ssubscribe")


class Subscriber:
    """`await route(channel)`: (the connection's name, `await make()` an unconnected redis-py asyncio
    Connection: RESP2, no read timeout, and whether it is sharded) for that channel; `on_lost(exc)`: called when
    a connection fails by itself (not on `reset`)."""

    def __init__(self, route: Callable[[str], Awaitable[tuple[str, Callable[[], Awaitable[object]], bool]]],
                 on_lost: Callable[[Exception], None]):
        self._route, self._on_lost = route, on_lost
        self._links: dict[str, _Link] = {}
        self._lost_links = dict(subscriber_connects=0, subscriber_lost=0)  # of links closed since

    @property
    def channels(self) -> int:
        return sum(link.channels for link in self._links.values())

    @property
    def counters(self) -> dict[str, int]:
        return {k: v + sum(link.counters[k] for link in self._links.values()) for k, v in self._lost_links.items()}

    @contextlib.asynccontextmanager
    async def subscription(self, channel: str) -> AsyncIterator[asyncio.Future]:
        name, make, sharded = await self._route(channel)
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = _Link(make, self._on_lost, SHARDED if sharded else PLAIN)
        async with link.subscription(channel) as message:
            yield message

    def reset(self, reason: Exception) -> None:
        """Drop every connection and wake every waiter with "lost" (the tier went down)."""
        for link in self._links.values():
            link.reset(reason)

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.close()
            for k in self._lost_links:
                self._lost_links[k] += link.counters[k]


class _Link:
    """One pub/sub connection and the channels waited on it."""

    def __init__(self, make_connection: Callable[[], Awaitable[object]], on_lost: Callable[[Exception], None],
                 kind: _Kind):
        self._make_connection, self._kind = make_connection, kind
        self._on_lost = on_lost
        self._conn = None
        self._connecting: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._channels: dict[bytes, _Channel] = {}
        self._confirmations: dict[bytes, deque[asyncio.Future]] = {}
        self._closing: set[asyncio.Task] = set()
        self._last_send: asyncio.Future | None = None
        self.counters = dict(subscriber_connects=0, subscriber_lost=0)

    @property
    def channels(self) -> int:
        return len(self._channels)

    @contextlib.asynccontextmanager
    async def subscription(self, channel: str) -> AsyncIterator[asyncio.Future]:
        conn = await self._connection()
        name = channel.encode()
        loop = asyncio.get_running_loop()
        message = loop.create_future()
        entry = self._channels.get(name)
        first = entry is None
        if first:
            entry = self._channels[name] = _Channel(loop.create_future())
            self._confirmations.setdefault(name, deque()).append(entry.confirmed)
        entry.waiters.add(message)
        try:
            if first:
                await self._send(conn, self._kind.subscribe, name)
            if not await asyncio.shield(entry.confirmed):
                raise SubscriberLost("redis pub/sub connection lost before the subscription was confirmed")
            yield message
        finally:
            entry.waiters.discard(message)
            if not entry.waiters and self._channels.get(name) is entry:
                del self._channels[name]
                with contextlib.suppress(SubscriberLost):
                    await self._send(conn, self._kind.unsubscribe, name)

    def reset(self, reason: Exception) -> None:
        """Drop the connection and wake every waiter with "lost" (the tier went down)."""
        self._lose(self._conn, reason, notify=False)

    async def close(self) -> None:
        tasks = [t for t in (self._connecting, self._reader) if t is not None]
        self.reset(SubscriberLost("closed"))  # wakes the waiters, closes the connection behind
        await background.stop(tasks)
        await asyncio.gather(*self._closing, return_exceptions=True)

    # ---- connection ------------------------------------------------------------------------------

    async def _connection(self):
        if self._conn is not None:
            return self._conn
        if self._connecting is None:
            self._connecting = asyncio.create_task(self._connect(), name="redis-subscriber-connect")
            self._connecting.add_done_callback(_retrieve)
        return await asyncio.shield(self._connecting)

    async def _connect(self):
        try:
            conn = await self._make_connection()
            await conn.connect()
        finally:
            self._connecting = None
        self._conn = conn
        self._reader = asyncio.create_task(self._read(conn), name="redis-subscriber")
        self.counters["subscriber_connects"] += 1
        return conn

    async def _send(self, conn, *command: bytes) -> None:
        # A task, so that it finishes even when this waiter is cancelled, chained to the one before it, so that
        # commands go out in the order they were asked for (an UNSUBSCRIBE never overtakes its SUBSCRIBE).
        sending = asyncio.ensure_future(self._send_after(self._last_send, conn, command))
        sending.add_done_callback(_retrieve)
        self._last_send = sending
        await asyncio.shield(sending)

    async def _send_after(self, previous: asyncio.Future | None, conn, command: tuple[bytes, ...]) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        if conn is not self._conn or not conn.is_connected:  # lost: redis-py would connect it again to send
            raise SubscriberLost("redis pub/sub connection lost")
        try:
            await conn.send_command(*command)
        except Exception as exc:
            self._lose(conn, exc)
            raise SubscriberLost(f"redis pub/sub connection lost: {exc!r}") from exc
        if conn is not self._conn:  # lost meanwhile: redis-py may have reconnected it to send; close it
            self._disconnect_later(conn)
            raise SubscriberLost("redis pub/sub connection lost")

    async def _read(self, conn) -> None:
        try:
            while True:
                self._dispatch(await conn.read_response())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._lose(conn, exc)

    def _dispatch(self, reply) -> None:
        """RESP2 pub/sub replies: [b"message", channel, data], [b"subscribe" | b"unsubscribe", channel, count]
        (sharded: smessage, ssubscribe, sunsubscribe)."""
        if not isinstance(reply, list) or len(reply) != 3:
            return
        kind, name, data = reply
        if kind == self._kind.message:
            entry = self._channels.get(name)
            for waiter in entry.waiters if entry is not None else ():
                if not waiter.done():
                    waiter.set_result(data)
        elif kind == self._kind.confirmed:
            queue = self._confirmations.get(name)
            if queue:
                confirmed = queue.popleft()
                if not queue:
                    del self._confirmations[name]
                if not confirmed.done():
                    confirmed.set_result(True)

    def _lose(self, conn, exc: Exception, notify: bool = True) -> None:
        if conn is None or conn is not self._conn:
            return
        self._conn = None
        self.counters["subscriber_lost"] += 1
        for entry in self._channels.values():
            for waiter in entry.waiters:
                if not waiter.done():
                    waiter.set_result(None)
        for queue in self._confirmations.values():
            for confirmed in queue:
                if not confirmed.done():
                    confirmed.set_result(False)
        self._channels.clear()
        self._confirmations.clear()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
        self._disconnect_later(conn)
        if notify:
            log.debug("redis pub/sub connection lost: %r", exc)
            self._on_lost(exc)

    def _disconnect_later(self, conn) -> None:
        task = asyncio.get_running_loop().create_task(conn.disconnect(nowait=True))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Task) -> None:
    """Mark a background task's exception as seen: the waiters got their own answer already."""
    if not task.cancelled():
        task.exception()
