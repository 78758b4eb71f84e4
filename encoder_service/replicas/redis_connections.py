"""The Redis tier's connections, for every kind of Redis an operator runs: one server, a Redis Cluster, or a
master watched by Sentinels, as `--redis-url` says (redis_url.py: a plain redis:// URL is asked at connect
whether it names a Cluster node, INFO cluster; the Cluster is then found from that node).

What the rest of the tier relies on, whatever the kind:

  - At most `max_connections` commands (or pipelines) at once; more wait for a slot, up to `wait_s`
    (counted as pool waits), then raise `PoolTimeout`. Running out is local back-pressure, never "Redis is
    down" (redis-py's asyncio ConnectionPool raises MaxConnectionsError, a ConnectionError, instead of waiting).
  - A command that fails with a connection error runs once more after closing the idle connections (after a
    restart they are all dead). A timeout is not retried: that would double a request's stall on a Redis that
    stopped answering; redis-py's own retries stay off for the same reason. MOVED and ASK (a Cluster's slots
    moving) are redis-py's business: they never reach the tier.
  - `pipelined`: one round trip per node, never a MULTI/EXEC transaction (Redis over maxmemory with
    `noeviction` refuses every MULTI, even of reads). In a Cluster every command's keys must share a slot
    (the tier's names for one id do: directory.py's hash tags). Scripts (`LuaScript`) run as EVALSHA; those a
    node does not have yet (NOSCRIPT: new, restarted, promoted) are loaded and run again, a second round trip
    only then.
  - `on_primaries`: one command on every primary (INFO for the heartbeat), by address.
  - `pubsub_route`: where a channel's messages are waited for (subscriber.py): one connection to the server, the
    Sentinels' master or one primary of a Cluster (plain pub/sub: a PUBLISH reaches every node's subscribers);
    or, on a Cluster of Redis >= 7, the master of the channel's slot (sharded: a "publish" goes out as
    SPUBLISH, to that master alone, never over the cluster bus).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError, SlotNotCoveredError

from encoder_service.redis_url import CLUSTER, SENTINEL, STANDALONE, parse_url

try:  # deadlines for a block of awaits; unlike asyncio.wait_for on 3.11, they never swallow a cancellation
    from asyncio import timeout, timeout_at  # 3.11+
except ImportError:  # 3.10: redis-py depends on async-timeout there
    from async_timeout import timeout, timeout_at  # type: ignore[no-redef]  # noqa: F401 - timeout_at: redis_tier's

_SCRIPTS: dict[str, str] = {}  # sha -> source of every LuaScript made: what a NOSCRIPT reply needs loaded
# Commands a Cluster pipeline takes only through execute_command (redis-py blocks their methods there).
_RAW = {"evalsha", "publish", "info"}


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
    def __init__(self, url: str, *, max_connections: int, wait_s: float, socket_timeout_s: float,
                 connect_timeout_s: float):
        self.target = parse_url(url)
        self.kind = self.target.kind  # None until the first connect says: one server, or a Cluster
        self.wait_s = wait_s
        self._max_connections = max_connections
        self._timeouts = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s)
        self._slots = asyncio.Semaphore(max_connections)
        self._client: aioredis.Redis | RedisCluster | None = None
        self._opening: asyncio.Lock | None = None
        self.sharded = False  # a Cluster whose primaries all have sharded pub/sub: SPUBLISH, SSUBSCRIBE
        self.counters = dict(pool_waits=0, pool_timeouts=0, retries=0)

    async def run(self, command: str, *args, **kwargs):
        """`client.<command>(*args, **kwargs)`, e.g. `run("get", key)`, in a slot, retried once on a fresh
        connection after a connection error."""
        async def one():
            return await getattr(await self._connected(), command)(*args, **kwargs)

        return await self._in_slot(one)

    async def pipelined(self, *commands: tuple, raise_on_error: bool = True) -> list:
        """One round trip of `commands` (each `(command, *args)`; `("set", key, value, px)`, with `nx=True` as
        a last element for SET NX), in order, NOT a transaction: their replies, and the first error reply
        raised (all commands ran); with `raise_on_error=False` error replies are returned in their place."""
        return await self._in_slot(self._pipeline, commands, raise_on_error)

    async def on_primaries(self, command: str, *args) -> dict[str, object]:
        """`command` on every primary (the server; the Sentinels' master; each primary of a Cluster): address ->
        its reply. Raises what the first failing one raised."""
        async def each():
            client = await self._connected()
            if self.kind != CLUSTER:
                reply = await client.execute_command(command, *args)  # first: a Sentinel's master is known then
                return {self._address(client): reply}
            nodes = client.get_primaries()
            replies = await asyncio.gather(*(client.execute_command(command, *args, target_nodes=node)
                                             for node in nodes))
            return {node.name: reply for node, reply in zip(nodes, replies)}

        return await self._in_slot(each)

    async def ping_primaries(self) -> dict[str, str]:
        """Every primary -> "up" or "down", by PING (and, while a Sentinel's master is down, "sentinels": whether
        they answer). Raises when not even the topology can be learned (no node answers)."""
        async def each():
            client = await self._connected()
            if self.kind == CLUSTER:
                nodes = {node.name: client.ping(target_nodes=node) for node in client.get_primaries()}
            else:
                nodes = {"primary": client.ping()}
            replies = await asyncio.gather(*nodes.values(), return_exceptions=True)
            states = {name: "down" if isinstance(r, Exception) else "up" for name, r in zip(nodes, replies)}
            if "primary" in states:  # its address: the server's, or the master a Sentinel named just now
                states[self._address(client)] = states.pop("primary")
            if self.kind == SENTINEL and "up" not in states.values():  # the Sentinels, while they fail over
                sentinels = client.connection_pool.sentinel_manager.sentinels
                answers = await asyncio.gather(*(s.ping() for s in sentinels), return_exceptions=True)
                states["sentinels"] = "down" if all(isinstance(a, Exception) for a in answers) else "up"
            return states

        return await self._in_slot(each)

    def nodes_down(self, exc: Exception) -> dict[str, str]:
        """What is known of the nodes when nothing answered: each one last known, "down"."""
        client = self._client
        if self.kind == CLUSTER and client is not None:
            return {node.name: "down" for node in client.get_primaries()}
        return {self.target.shown: "down"}

    async def refresh(self) -> None:
        """Learn the topology again (a Cluster's slots and primaries; a Sentinel's master): after a failover."""
        client = await self._connected()
        if self.kind == CLUSTER:
            await client.nodes_manager.initialize()
        await self.close_idle()

    async def close_idle(self) -> None:
        """Close the idle connections (they reconnect on next use): after an outage they may be dead."""
        client = self._client
        if client is None:
            return
        with contextlib.suppress(RedisError, OSError):  # closing a dead socket may complain; it is closed
            if self.kind == CLUSTER:
                for node in client.get_nodes():
                    await node.disconnect_free_connections()
            else:
                await client.connection_pool.disconnect(inuse_connections=False)

    async def pubsub_route(self, channel: str) -> tuple[str, Callable[[], Awaitable[object]], bool]:
        """Where to wait for `channel`'s messages (subscriber.py): (the connection's name, a maker of an
        unconnected connection, sharded or not). Sharded (a Cluster on Redis >= 7, whose PUBLISHes are SPUBLISH):
        the master of the channel's slot; else one connection for every channel: to the server, the Sentinels'
        master, or one primary of a Cluster (a plain PUBLISH is broadcast over the cluster bus)."""
        client = await self._in_slot(self._connected)
        if self.sharded:
            node: ClusterNode = client.get_node_from_key(channel)

            async def to_node():
                return self._pubsub_connection(node.connection_class, node.connection_kwargs)

            return node.name, to_node, True
        return "plain", self._plain_pubsub_connection, False

    async def _plain_pubsub_connection(self):
        client = await self._in_slot(self._connected)
        if self.kind == CLUSTER:
            node: ClusterNode = random.choice(client.get_primaries())
            return self._pubsub_connection(node.connection_class, node.connection_kwargs)
        pool = client.connection_pool
        return self._pubsub_connection(pool.connection_class, pool.connection_kwargs)

    @staticmethod
    def _pubsub_connection(connection_class, kwargs: dict):
        """Outside the pool: the same settings (auth, TLS) but RESP2 (pub/sub replies as plain arrays), no read
        timeout (it idles between messages) and TCP keepalive instead."""
        kwargs = dict(kwargs, socket_timeout=None, protocol=2)
        if issubclass(connection_class, aioredis.Connection):  # TCP or TLS; a unix socket has no keepalive
            kwargs["socket_keepalive"] = True
        return connection_class(**kwargs)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        await client.aclose()
        if self.kind != CLUSTER:
            await client.connection_pool.disconnect()

    # ---- the client of each kind ----------------------------------------------------------------------

    async def _connected(self):
        if self._client is not None:
            return self._client
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._client is None:
                self._client = await self._open()
        return self._client

    async def _open(self):
        no_retries = Retry(NoBackoff(), 0)
        if self.kind == SENTINEL:
            sentinel = Sentinel(list(self.target.nodes), sentinel_kwargs=dict(self.target.sentinel_options,
                                                                               **self._timeouts),
                                retry=no_retries, **self._timeouts)
            return sentinel.master_for(self.target.master, max_connections=self._max_connections,
                                       retry=no_retries, **self.target.options, **self._timeouts)
        if self.kind == CLUSTER:
            return await self._cluster()
        pool = BlockingConnectionPool.from_url(self.target.url, max_connections=self._max_connections,
                                               timeout=self.wait_s, retry=no_retries, **self._timeouts)
        client = aioredis.Redis(connection_pool=pool)
        try:
            cluster = (await client.info("cluster")).get("cluster_enabled")
        except BaseException:
            await client.aclose()
            await pool.disconnect()
            raise
        if not cluster:
            self.kind = STANDALONE
            return client
        await client.aclose()
        await pool.disconnect()
        self.kind = CLUSTER
        return await self._cluster()

    async def _cluster(self) -> RedisCluster:
        startup = [ClusterNode(host, port) for host, port in self.target.nodes[1:]]
        # No retries of redis-py's own (a lost node is the tier's "down", and its probe's business); MOVED and ASK
        # are followed all the same.
        client = RedisCluster.from_url(self.target.url, startup_nodes=startup or None,
                                       max_connections=self._max_connections, retry=Retry(NoBackoff(), 0),
                                       **self._timeouts)
        try:
            await client.initialize()
            servers = await client.execute_command("INFO", "server", target_nodes=RedisCluster.PRIMARIES)
        except BaseException:
            await client.aclose()
            raise
        # Sharded pub/sub (Redis >= 7 on every primary): a channel's messages stay on its slot's master.
        self.sharded = all(int(str(info.get("redis_version", "0")).split(".")[0]) >= 7
                           for info in servers.values())
        return client

    def _address(self, client) -> str:
        """host:port (or the socket path) of a standalone client's server; a Sentinel client's master as
        last resolved."""
        pool = client.connection_pool
        if self.kind == SENTINEL and pool is not None and getattr(pool, "master_address", None):
            host, port = pool.master_address
            return f"{host}:{port}"
        kwargs = pool.connection_kwargs
        return f"{kwargs['host']}:{kwargs['port']}" if "host" in kwargs else str(kwargs.get("path", "unix"))

    # ---- commands --------------------------------------------------------------------------------------

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
                return await _redis_errors(op(*args, **kwargs))
            except RedisConnectionError:
                # redis-py closed the failed connection; the idle ones are as old (after a restart, all dead):
                # close them too, so the retry runs on a fresh connection. Failing again is the caller's "down".
                self.counters["retries"] += 1
                await self.close_idle()
                return await _redis_errors(op(*args, **kwargs))
        finally:
            self._slots.release()

    async def _pipeline(self, commands: tuple, raise_on_error: bool) -> list:
        replies = await self._execute(commands)
        unloaded = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if unloaded:  # a node that has not seen these scripts yet (new, restarted, promoted): load, run again
            client = await self._connected()
            for sha in {commands[i][1] for i in unloaded}:
                if self.kind == CLUSTER:  # every primary: a script's keys may live on any of them
                    await client.execute_command("SCRIPT LOAD", _SCRIPTS[sha], target_nodes=RedisCluster.PRIMARIES)
                else:
                    await client.script_load(_SCRIPTS[sha])
            for i, reply in zip(unloaded, await self._execute(tuple(commands[i] for i in unloaded))):
                replies[i] = reply
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    async def _execute(self, commands: tuple) -> list:
        client = await self._connected()
        async with client.pipeline(transaction=False) as pipe:
            for command, *args in commands:
                if command == "set":
                    key, value, px, *nx = args
                    pipe.set(key, value, px=px, nx=bool(nx and nx[0]))
                elif command == "publish" and self.sharded:  # to the channel's slot's master, not broadcast
                    pipe.execute_command("SPUBLISH", *args)
                elif command in _RAW:
                    pipe.execute_command(command.upper(), *args)
                else:
                    getattr(pipe, command)(*args)
            return await pipe.execute(raise_on_error=False)


async def _redis_errors(awaitable):
    """redis-py's Cluster client raises some errors outside RedisError: a slot no live master serves (a failover
    under way) is a lost connection; any other (keys of one command in several slots, ...) an error reply."""
    try:
        return await awaitable
    except SlotNotCoveredError as exc:
        raise RedisConnectionError(f"cluster: {exc}") from exc
    except RedisClusterException as exc:
        raise ResponseError(f"CLUSTER {exc}") from exc
