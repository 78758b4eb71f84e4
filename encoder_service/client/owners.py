"""Fetches that go straight to the replica holding the rows.

Behind one Service any replica answers any fetch (with Redis): one that does not hold the rows fetches them
from the one that does and passes them on (a second hop of the rows). The encode answer names that replica
(`owner`: its advertised http:// address), so a client that can reach it fetches there directly:

    transport = OwnerRouting(HttpTransport(service_url), lambda url: HttpTransport(url))

remembers each id's owner from the encode answers (bounded, oldest forgotten first) and sends a fetch whose
ids all have one owner, other than the Service, to that owner. An owner that cannot be reached, does not
answer within OWNER_S (frozen, hung, its packets dropped), or no longer has the rows (evicted, restarted), is
forgotten and the fetch goes to the Service, which finds the rows wherever they are now: never an error only
the direct path would give. The owner is asked with a timeout of OWNER_S at most (it answers 504 itself when
the rows are not ready by then: then the Service is asked with what is left of the caller's, the owner
kept). Shared-memory fetches, which need a server on this host, and everything else go to the Service as
they are. A fetch by IPC (client/base.py) asks the
owner first too (`owner_of`); a replica that answers it "not here" names the owner, which is remembered
(`learn_owner`) and asked next.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from encoder_service import errors
from encoder_service.protocol.video_info import GROUP_SEP
from encoder_service.rowpath.raw_http import NoAnswer

MAX_IDS = 1 << 16  # ids whose owner is remembered
MAX_OWNERS = 64  # owners with a transport kept open (one per replica: those past it are reached via the Service)
OWNER_S = 2.0  # the owner's try: its wait for rows still encoding, and each socket operation (then the Service)
FALLBACK = (errors.Unavailable, errors.NotFound, NoAnswer)  # the owner is gone, silent, or lost the rows


class _Owners:
    """id -> owner URL (video ids stand for their frame groups), and one transport per owner. Thread-safe."""

    def __init__(self, service_url: str, make: Callable[[str], object]):
        self._service_url, self._make = service_url.rstrip("/"), make
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._transports: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = dict(direct=0, fallbacks=0)

    def learn(self, infos: Iterable) -> None:
        with self._lock:
            for info in infos:
                owner = getattr(info, "owner", None)
                if owner and owner.rstrip("/") != self._service_url:
                    self._ids[info.id] = owner.rstrip("/")
                    self._ids.move_to_end(info.id)
            while len(self._ids) > MAX_IDS:
                self._ids.popitem(last=False)

    def assign(self, items, owner: str) -> None:
        """A replica said `owner` holds these items' rows."""
        owner = owner.rstrip("/")
        if owner == self._service_url:
            return
        with self._lock:
            for item_id, _ in items:
                base = item_id.partition(GROUP_SEP)[0]
                self._ids[base] = owner
                self._ids.move_to_end(base)
            while len(self._ids) > MAX_IDS:
                self._ids.popitem(last=False)

    def transport_for(self, items) -> tuple[str, object] | None:
        """(owner, its transport) when every item's id has that one owner; else None (the Service)."""
        with self._lock:
            owners = {self._ids.get(item_id.partition(GROUP_SEP)[0]) for item_id, _ in items}
            if len(owners) != 1 or None in owners:
                return None
            (owner,) = owners
            transport = self._transports.get(owner)
            if transport is None:
                if len(self._transports) >= MAX_OWNERS:  # more replicas than that: the rest via the Service
                    return None
                transport = self._transports[owner] = self._make(owner)
            return owner, transport

    def forget(self, owner: str) -> list:
        """`owner` failed: its ids go to the Service from now on; returns its transport to close."""
        with self._lock:
            self.counters["fallbacks"] += 1
            for item_id in [i for i, o in self._ids.items() if o == owner]:
                del self._ids[item_id]
            transport = self._transports.pop(owner, None)
            return [transport] if transport is not None else []

    def close(self) -> list:
        with self._lock:
            transports, self._transports = list(self._transports.values()), OrderedDict()
            return transports


class OwnerRouting:
    """A blocking transport (client/http.py) whose fetches go to the ids' owner when it answers."""

    def __init__(self, transport, make: Callable[[str], object], service_url: str):
        self._transport, self._owners = transport, _Owners(service_url, make)

    def __getattr__(self, name: str):  # fetch_shm, release, metadata: the Service's
        return getattr(self._transport, name)

    @property
    def routed(self) -> dict:
        """Fetches sent to an owner directly, and owners given up for the Service."""
        return dict(self._owners.counters)

    def owner_of(self, items) -> tuple[str, object] | None:
        """(owner, its transport) when every item's id has that one owner (a fetch by IPC asks it first)."""
        return self._owners.transport_for(items)

    def learn_owner(self, owner: str, items) -> tuple[str, object] | None:
        """A replica answered that `owner` holds these items' rows: remembered (later fetches of them go there);
        (owner, its transport), or None when that is the Service or an owner past MAX_OWNERS."""
        self._owners.assign(items, owner)
        return self._owners.transport_for(items)

    def given_up(self, owner: str) -> None:
        """`owner` failed (unreachable, or lost the rows): its ids go to the Service from now on."""
        for stale in self._owners.forget(owner):
            stale.close()

    def encode(self, images, wait, return_embeddings, timeout, **ipc):
        infos = self._transport.encode(images, wait, return_embeddings, timeout, **ipc)
        self._owners.learn(infos)
        return infos

    def encode_videos(self, videos, wait, return_embeddings, timeout):
        infos = self._transport.encode_videos(videos, wait, return_embeddings, timeout)
        self._owners.learn(infos)
        return infos

    def fetch(self, items, start, end, dest, timeout):
        target = self._owners.transport_for(items)
        if target is not None:
            owner, transport = target
            t0 = time.monotonic()
            try:
                result = transport.fetch(items, start, end, dest, _owner_timeout(timeout))
                self._owners.counters["direct"] += 1
                return result
            except FALLBACK:
                self.given_up(owner)
            except errors.DeadlineExceeded:  # the owner's own 504: its rows were not ready within OWNER_S
                if not _time_left(timeout, t0):
                    raise
            timeout = _rest(timeout, t0)
        return self._transport.fetch(items, start, end, dest, timeout)

    def close(self) -> None:
        for transport in self._owners.close():
            transport.close()
        self._transport.close()


class AsyncOwnerRouting(OwnerRouting):
    """The same for the asyncio transports (client/http.py: AsyncHttpTransport)."""

    async def given_up(self, owner: str) -> None:
        for stale in self._owners.forget(owner):
            await stale.close()

    async def encode(self, images, wait, return_embeddings, timeout, **ipc):
        infos = await self._transport.encode(images, wait, return_embeddings, timeout, **ipc)
        self._owners.learn(infos)
        return infos

    async def encode_videos(self, videos, wait, return_embeddings, timeout):
        infos = await self._transport.encode_videos(videos, wait, return_embeddings, timeout)
        self._owners.learn(infos)
        return infos

    async def fetch(self, items, start, end, dest, timeout):
        target = self._owners.transport_for(items)
        if target is not None:
            owner, transport = target
            t0 = time.monotonic()
            try:
                result = await transport.fetch(items, start, end, dest, _owner_timeout(timeout))
                self._owners.counters["direct"] += 1
                return result
            except FALLBACK:
                await self.given_up(owner)
            except errors.DeadlineExceeded:
                if not _time_left(timeout, t0):
                    raise
            timeout = _rest(timeout, t0)
        return await self._transport.fetch(items, start, end, dest, timeout)

    async def close(self) -> None:
        for transport in self._owners.close():
            await transport.close()
        await self._transport.close()


def _owner_timeout(timeout: float | None) -> float:
    return OWNER_S if timeout is None else min(timeout, OWNER_S)


def _time_left(timeout: float | None, t0: float) -> bool:
    return timeout is None or time.monotonic() - t0 < timeout


def _rest(timeout: float | None, t0: float) -> float | None:
    """What is left of the caller's timeout after the owner's try (0: the Service answers what is ready)."""
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
