"""The Redis tier's connections to one Redis: bounded, waiting, and fresh again after a restart.

  - At most `max_connections` commands (or pipelines) at once; more wait for a slot, up to `wait_s`
    (counted as pool waits), then raise `PoolTimeout`. Running out is local back-pressure, never "Redis is
    down": redis-py's asyncio ConnectionPool raises MaxConnectionsError, a ConnectionError, instead of
    waiting, and its BlockingConnectionPool raises a ConnectionError after its timeout. The slots keep both
    from happening: the (blocking) pool has exactly as many connections, so it never waits itself.
  - A command that fails with a connection error runs once more after closing the idle pooled
    connections: after a Redis restart they are all dead, so the retry runs on a fresh one. A timeout is
    not retried: that would double a request's stall on a Redis that stopped answering. redis-py's own
    retries stay off (`Retry(NoBackoff(), 0)`) for the same reason (they also retry timeouts and connects).
  - `pipelined`: one round trip, never a MULTI/EXEC transaction (Redis over maxmemory with `noeviction`
    refuses every MULTI, even of reads, while plain commands still work). Scripts (`LuaScript`) run as
    EVALSHA; those a Redis does not have yet (NOSCRIPT: a new or restarted one) are loaded and run again,
    a second round trip only then.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import redis.asyncio as aioredis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

try:  # deadlines for a block of awaits; unlike asyncio.wait_for on 3.11, they never swallow a cancellation
    from asyncio import timeout, timeout_at  # 3.11+
except ImportError:  # 3.10: redis-py depends on async-timeout there
    from async_timeout import timeout, timeout_at  # type: ignore[no-redef]  # noqa: F401 - timeout_at: redis_tier's


_SCRIPTS: dict[str, str] = {}  # sha -> source of every LuaScript made: what a NOSCRIPT reply needs loaded


class LuaScript:
    """A Lua script, run in a pipeline as `script.command(keys, args)` (EVALSHA)."""

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        _SCRIPTS[self.sha] = source

    def command(self, keys: tuple[str, ...], args: tuple) -> tuple:
        return ("evalsha", self.sha, len(keys), *keys, *args)


class PoolTimeout(Exception):
    """No connection free within `wait_s`: this process is busy, Redis may be fine (a miss, not down)."""


class Connections:
    def __init__(
        self, url: str, *, max_connections: int, wait_s: float, socket_timeout_s: float, connect_timeout_s: float
    ):
        self.wait_s = wait_s
        self._slots = asyncio.Semaphore(max_connections)
        self._pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=wait_s,  # a backstop only (see above)
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._client = aioredis.Redis(connection_pool=self._pool)
        self.counters = dict(pool_waits=0, pool_timeouts=0, retries=0)

    async def run(self, command: str, *args, **kwargs):
        """`client.<command>(*args, **kwargs)`, e.g. `run("get", key)`, in a slot, retried once on a fresh
        connection after a connection error."""
        return await self._in_slot(getattr(self._client, command), *args, **kwargs)

    async def pipelined(self, *commands: tuple, raise_on_error: bool = True) -> list:
        """One round trip of `commands` (each `(command, *args)`; `("set", key, value, px)`, with `nx=True` as
        a last element for SET NX), in order, NOT a transaction: their replies, and the first error reply
        raised (all commands ran); with `raise_on_error=False` error replies are returned in their place."""
        return await self._in_slot(self._pipeline, commands, raise_on_error)

    async def close_idle(self) -> None:
        """Close the idle pooled connections (they reconnect on next use): after an outage they may be dead."""
        with contextlib.suppress(RedisError, OSError):  # closing a dead socket may complain; it is closed
            await self._pool.disconnect(inuse_connections=False)

    def pubsub_connection(self):
        """An unconnected connection for pub/sub (subscriber.py), outside the pool: the pool's settings (URL,
        auth, TLS) but RESP2 (pub/sub replies as plain arrays), no read timeout (it idles between messages)
        and TCP keepalive instead."""
        connection_class = self._pool.connection_class
        kwargs = dict(self._pool.connection_kwargs, socket_timeout=None, protocol=2)
        if issubclass(connection_class, aioredis.Connection):  # TCP or TLS; a unix socket has no keepalive
            kwargs["socket_keepalive"] = True
        return connection_class(**kwargs)

    async def close(self) -> None:
        await self._client.aclose()
        await self._pool.disconnect()

    async def _in_slot(self, op, *args, **kwargs):
        if not self._slots.locked():
            await self._slots.acquire()  # free: taken without yielding
        else:
            self.counters["pool_waits"] += 1
            try:
                async with timeout(self.wait_s):
                    await self._slots.acquire()
            except TimeoutError:
                self.counters["pool_timeouts"] += 1
                raise PoolTimeout(f"no Redis connection free within {self.wait_s} s") from None
        try:
            try:
                return await op(*args, **kwargs)
            except RedisConnectionError:
                # redis-py closed the failed connection; the idle ones are as old (after a restart, all dead):
                # close them too, so the retry runs on a fresh connection. Failing again is the caller's "down".
                self.counters["retries"] += 1
                await self.close_idle()
                return await op(*args, **kwargs)
        finally:
            self._slots.release()

    async def _pipeline(self, commands: tuple, raise_on_error: bool) -> list:
        replies = await self._execute(commands, raise_on_error=False)
        unloaded = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if unloaded:  # a Redis that has not seen these scripts yet (new, restarted): load them, run those again
            shas = {commands[i][1] for i in unloaded}
            await self._execute(tuple(("script_load", _SCRIPTS[sha]) for sha in shas), raise_on_error=True)
            for i, reply in zip(unloaded, await self._execute(tuple(commands[i] for i in unloaded), False)):
                replies[i] = reply
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    async def _execute(self, commands: tuple, raise_on_error: bool) -> list:
        async with self._client.pipeline(transaction=False) as pipe:
            for command, *args in commands:
                if command == "set":
                    key, value, px, *nx = args
                    pipe.set(key, value, px=px, nx=bool(nx and nx[0]))
                else:
                    getattr(pipe, command)(*args)
            return await pipe.execute(raise_on_error=raise_on_error)
