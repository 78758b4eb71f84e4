"""Fetches that go straight to the replica holding the rows.

Behind one Service any replica answers any fetch (with Redis): one that does not hold the rows fetches them
from the one that does and passes them on (a second hop of the rows). The encode answer names that replica
(`owner`: its advertised http:// address), so a client that can reach it fetches there directly:

    transport = OwnerRouting(HttpTransport(service_url), lambda url: HttpTransport(url), service_url)

remembers each id's owner from the encode answers (bounded, oldest forgotten first) and sends a fetch whose
ids all have one owner, other than the Service, to that owner. Every call that asks an owner (a socket fetch
here, a fetch by IPC: client/ipc_route.py) follows the same rules (`OwnerTry`): the owner is asked with a
timeout of OWNER_S at most; one that cannot be reached, does not answer within it (frozen, hung, its packets
dropped), or no longer has the rows (evicted, restarted), is forgotten and the call goes to the Service,
which finds the rows wherever they are now: never an error only the direct path would give. An owner that
answers 504 itself (its rows not ready within OWNER_S) is kept, and the Service is asked with what is left
of the caller's timeout (none left: DeadlineExceeded). Shared-memory fetches, which need a server on this
host, and everything else go to the Service as they are.

A transport is kept per owner (at most MAX_OWNERS, the least recently used closed past that). One given up,
or pushed out, is closed in the background once no call uses it, without sending its pending
acknowledgements (a dead owner would hold up the fallback; the holds end at their lease).

Trust: an owner's address comes from the Service's answers (the replicas' Redis directory), and the client
sends it the same bearer token as the Service. Whoever can write that directory or answer as the Service
can point a client's token at any address: keep Redis and the replicas on a network of their own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from encoder_service import errors
from encoder_service.protocol.video_info import GROUP_SEP
from encoder_service.rowpath.raw_http import NoAnswer

MAX_IDS = 1 << 16  # ids whose owner is remembered
MAX_OWNERS = 64  # owners with a transport kept open (one per replica: the least recently used closed past it)
OWNER_S = 2.0  # the owner's try: its wait for rows still encoding, and each socket operation (then the Service)
FALLBACK = (errors.Unavailable, errors.NotFound, NoAnswer)  # the owner is gone, silent, or lost the rows


def remaining(timeout: float | None, t0: float, spent: BaseException | None = None) -> float | None:
    """What is left of a caller's `timeout` (from `t0`); DeadlineExceeded when nothing is (`spent`: the error
    that used it up, raised as it is when it is one), never a 0 a socket would take for non-blocking."""
    if timeout is None:
        return None
    left = timeout - (time.monotonic() - t0)
    if left > 0:
        return left
    if isinstance(spent, errors.DeadlineExceeded):
        raise spent
    raise errors.DeadlineExceeded(f"the call's timeout of {timeout:g} s is used up") from spent


class _Owner:
    """One owner's transport and the calls using it now (a transport given up is closed once none does)."""

    __slots__ = ("url", "transport", "users", "dropped")

    def __init__(self, url: str, transport):
        self.url, self.transport, self.users, self.dropped = url, transport, 0, False


class _Owners:
    """id -> owner URL (video ids stand for their frame groups), and one transport per owner (`make(url)`), an
    LRU of MAX_OWNERS; `retire(transport)` closes one in the background (given up, or pushed out, once no
    call uses it). Thread-safe."""

    def __init__(self, service_url: str, make: Callable[[str], object], retire: Callable[[object], None]):
        self.service_url, self._make, self._retire = service_url.rstrip("/"), make, retire
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._owners: OrderedDict[str, _Owner] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = dict(direct=0, fallbacks=0)

    def learn(self, infos: Iterable) -> None:
        """Encode answers: each id's `owner`."""
        self._remember((info.id, getattr(info, "owner", None)) for info in infos)

    def assign(self, items, owner: str) -> None:
        """A replica said `owner` holds these items' rows."""
        self._remember((item_id.partition(GROUP_SEP)[0], owner) for item_id, _ in items)

    def _remember(self, pairs: Iterable[tuple[str, str | None]]) -> None:
        with self._lock:
            for item_id, owner in pairs:
                owner = owner.rstrip("/") if owner else None
                if owner and owner != self.service_url:
                    self._ids[item_id] = owner
                    self._ids.move_to_end(item_id)
            while len(self._ids) > MAX_IDS:
                self._ids.popitem(last=False)

    def take(self, items) -> _Owner | None:
        """The owner every item's id has (one, not the Service), its transport in use until `done`; else None."""
        with self._lock:
            urls = {self._ids.get(item_id.partition(GROUP_SEP)[0]) for item_id, _ in items}
            if len(urls) != 1 or None in urls:
                return None
            (url,) = urls
            owner = self._owners.get(url)
            if owner is None:
                owner = self._owners[url] = _Owner(url, self._make(url))
                while len(self._owners) > MAX_OWNERS:
                    self._drop(self._owners.popitem(last=False)[1])
            self._owners.move_to_end(url)
            owner.users += 1
            return owner

    def done(self, owner: _Owner) -> None:
        with self._lock:
            owner.users -= 1
            idle = owner.dropped and owner.users == 0
        if idle:
            self._retire(owner.transport)

    def forget(self, url: str) -> None:
        """`url` failed: its ids go to the Service from now on, its transport closed once idle."""
        with self._lock:
            self.counters["fallbacks"] += 1
            for item_id in [i for i, o in self._ids.items() if o == url]:
                del self._ids[item_id]
            owner = self._owners.pop(url, None)
            if owner is not None:
                self._drop(owner)

    def _drop(self, owner: _Owner) -> None:
        """(under the lock) `owner` leaves the map: closed now if idle, else by its last call's `done`."""
        owner.dropped = True
        if owner.users == 0:
            self._retire(owner.transport)

    def close(self) -> list:
        """The transports kept (to close, with their acknowledgements)."""
        with self._lock:
            owners, self._owners = list(self._owners.values()), OrderedDict()
            for owner in owners:
                owner.dropped = True
            return [owner.transport for owner in owners if owner.users == 0]


class OwnerTry:
    """One call's try of its ids' owner (None: no owner known), with the rules above:

        attempt = routing.attempt(items, timeout)
        try: result = call(attempt.transport, attempt.timeout); attempt.succeeded()
        except BaseException as exc: timeout = attempt.failed(exc)   # raises unless the Service is to be asked
    """

    def __init__(self, owners: _Owners, items, timeout: float | None):
        self._owners, self._t0, self._caller_timeout = owners, time.monotonic(), timeout
        self._owner = owners.take(items)

    @property
    def url(self) -> str | None:
        return None if self._owner is None else self._owner.url

    @property
    def transport(self):
        return self._owner.transport

    @property
    def timeout(self) -> float:
        """The owner's: OWNER_S at most."""
        return OWNER_S if self._caller_timeout is None else min(self._caller_timeout, OWNER_S)

    def succeeded(self) -> None:
        self._owners.counters["direct"] += 1
        self._owners.done(self._owner)

    def failed(self, exc: BaseException) -> float | None:
        """The owner's call raised `exc`: the timeout left for the Service's; `exc` raised again when the call
        ends here (a cancel, an error the Service would repeat, the caller's timeout used up)."""
        self._owners.done(self._owner)
        if isinstance(exc, FALLBACK):
            self._owners.forget(self._owner.url)  # gone, silent, or lost the rows: the Service finds them
        elif not isinstance(exc, errors.DeadlineExceeded):  # (the owner's own 504: kept, the Service asked)
            raise exc
        return remaining(self._caller_timeout, self._t0, exc)


class OwnerRouting:
    """A blocking transport (client/http.py) whose fetches go to the ids' owner when it answers."""

    def __init__(self, transport, make: Callable[[str], object], service_url: str):
        self._transport = transport
        self._retiring: list[threading.Thread] = []
        self._owners = _Owners(service_url, make, self._retire)

    def __getattr__(self, name: str):  # fetch_shm, release, metadata: the Service's
        return getattr(self._transport, name)

    @property
    def routed(self) -> dict:
        """Fetches sent to an owner directly, and owners given up for the Service."""
        return dict(self._owners.counters)

    @property
    def service(self):
        """The Service's transport."""
        return self._transport

    def attempt(self, items, timeout: float | None) -> OwnerTry:
        """A call's try of these items' owner (`url` None: none known, ask the Service)."""
        return OwnerTry(self._owners, items, timeout)

    def learn_owner(self, owner: str, items) -> None:
        """A replica answered that `owner` holds these items' rows: later calls of them go there."""
        self._owners.assign(items, owner)

    def encode(self, images, wait, return_embeddings, timeout, **ipc):
        infos = self._transport.encode(images, wait, return_embeddings, timeout, **ipc)
        self._owners.learn(infos)
        return infos

    def encode_videos(self, videos, wait, return_embeddings, timeout):
        infos = self._transport.encode_videos(videos, wait, return_embeddings, timeout)
        self._owners.learn(infos)
        return infos

    def fetch(self, items, start, end, dest, timeout):
        attempt = self.attempt(items, timeout)
        if attempt.url is not None:
            try:
                result = attempt.transport.fetch(items, start, end, dest, attempt.timeout)
                attempt.succeeded()
                return result
            except BaseException as exc:  # noqa: BLE001 - failed() raises it again unless the Service is next
                timeout = attempt.failed(exc)
        return self._transport.fetch(items, start, end, dest, timeout)

    def _retire(self, transport) -> None:
        thread = threading.Thread(target=transport.close, kwargs={"acknowledge": False}, daemon=True,
                                  name="encoder-owner-close")
        thread.start()
        self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]

    def close(self) -> None:
        for transport in self._owners.close():
            transport.close()
        for thread in self._retiring:
            thread.join()
        self._transport.close()


class AsyncOwnerRouting(OwnerRouting):
    """The same for the asyncio transports (client/http.py: AsyncHttpTransport); used on one event loop."""

    def __init__(self, transport, make: Callable[[str], object], service_url: str):
        super().__init__(transport, make, service_url)
        self._closing: set[asyncio.Task] = set()

    async def encode(self, images, wait, return_embeddings, timeout, **ipc):
        infos = await self._transport.encode(images, wait, return_embeddings, timeout, **ipc)
        self._owners.learn(infos)
        return infos

    async def encode_videos(self, videos, wait, return_embeddings, timeout):
        infos = await self._transport.encode_videos(videos, wait, return_embeddings, timeout)
        self._owners.learn(infos)
        return infos

    async def fetch(self, items, start, end, dest, timeout):
        attempt = self.attempt(items, timeout)
        if attempt.url is not None:
            try:
                result = await attempt.transport.fetch(items, start, end, dest, attempt.timeout)
                attempt.succeeded()
                return result
            except BaseException as exc:  # noqa: BLE001 - as OwnerRouting.fetch's
                timeout = attempt.failed(exc)
        return await self._transport.fetch(items, start, end, dest, timeout)

    def _retire(self, transport) -> None:  # (called on the loop: by a fetch, a failure, a push-out)
        task = asyncio.get_running_loop().create_task(transport.close(acknowledge=False))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for transport in self._owners.close():
            await transport.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        await self._transport.close()
