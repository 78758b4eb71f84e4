"""Where one fetch by IPC is sent (client/ipc.py has the copy), for the clients (client/base.py, blocking and
asyncio) and the vLLM connector's scheduler side (integrations/vllm/fetch.py):

  1. the ids' owner when one is known, by the owner rules (client/owners.py: OwnerTry: OWNER_S at most; gone,
     silent or without the rows: given up, the Service asked with what is left of the timeout);
  2. else the Service; a replica there without the ids answers "not here" naming their owner, which is
     remembered and asked once (not the one this fetch just gave up: the directory may name it still); that
     owner failing, the Service's answer stands (the fetch goes the next way).

Each request acknowledges the copies done under its server's earlier holds (`Acks.take`); a request that
fails gives them back (`Acks.restore`): a later one, or the acks' thread, sends them.

`IpcRoute.run` sends a fetch by IPC along the route (blocking), `run_async` the same from asyncio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from encoder_service.client.ipc import held_request
from encoder_service.client.owners import FALLBACK, OwnerRouting, OwnerTry, remaining
from encoder_service.errors import DeadlineExceeded
from encoder_service.protocol.ipc import IpcPlacement, IpcUnavailable
from encoder_service.protocol.wire import WireHeader


@dataclass(frozen=True)
class IpcAnswer:
    header: WireHeader | None
    answer: IpcPlacement | IpcUnavailable
    transport: object  # the server's that answered: its `ipc_acks` get the hold's token
    server: str  # its address (the reader's arenas are remembered per server: client/ipc.py: Generations)
    sent: float  # time.monotonic() before the request went (the lease check)


@dataclass(frozen=True)
class IpcAsk:
    """One request of the route: to `transport`, within `timeout`, acknowledging `tokens`."""
    transport: object
    timeout: float | None
    tokens: tuple[str, ...]

    @property
    def request(self) -> dict:
        return held_request(self.tokens)


class IpcRoute:
    """The route of one fetch by IPC of `items` (`service`: the Service's transport; `routing`: its owner
    routing, None without one), taken by `run` or `run_async` (the same steps: `next`, then `answered` or
    `failed`, which raises when the fetch fails)."""

    def __init__(self, service, routing: OwnerRouting | None, items, timeout: float | None):
        self._service, self._routing, self._items = service, routing, items
        self._timeout, self._t0 = timeout, time.monotonic()
        self._owner: OwnerTry | None = routing.attempt(items, timeout) if routing is not None else None
        if self._owner is not None and self._owner.url is None:
            self._owner = None
        self._given_up: str | None = None
        self._named_asked = False
        self._service_timeout = timeout
        self._to_service = self._owner is None
        self.result: IpcAnswer | None = None
        self._sent = 0.0

    def run(self, start: int, end: int) -> IpcAnswer:
        """The fetch of rows [start, end) by IPC along the route, on blocking transports."""
        while (ask := self.next()) is not None:
            try:
                header, answer = ask.transport.fetch_ipc(self._items, start, end, ask.request, ask.timeout)
            except BaseException as exc:  # noqa: BLE001 - failed() raises it again unless the route goes on
                self.failed(ask, exc)
                continue
            self.answered(ask, header, answer)
        return self.result

    async def run_async(self, start: int, end: int) -> IpcAnswer:
        """`run` on asyncio transports."""
        while (ask := self.next()) is not None:
            try:
                header, answer = await ask.transport.fetch_ipc(self._items, start, end, ask.request, ask.timeout)
            except BaseException as exc:  # noqa: BLE001 - as run's
                self.failed(ask, exc)
                continue
            self.answered(ask, header, answer)
        return self.result

    def next(self) -> IpcAsk | None:
        """The next request to send, None when `result` is the answer."""
        if self._owner is not None:
            transport, timeout = self._owner.transport, self._owner.timeout
        elif self._to_service:
            transport, timeout = self._service, self._service_timeout
        else:
            return None
        self._sent = time.monotonic()
        return IpcAsk(transport, timeout, tuple(transport.ipc_acks.take()))

    def answered(self, ask: IpcAsk, header: WireHeader | None, answer: IpcPlacement | IpcUnavailable) -> None:
        result = IpcAnswer(header, answer, ask.transport, ask.transport.base_url, self._sent)
        if ask.transport is not self._service:  # an owner's answer stands, whatever it is
            self._owner.succeeded()
            self._owner, self.result = None, result
            return
        self._to_service, self.result = False, result
        named = answer.owner if isinstance(answer, IpcUnavailable) else None
        if named and self._routing is not None and not self._named_asked and named.rstrip("/") != self._given_up:
            self._named_asked = True
            self._routing.learn_owner(named, self._items)
            try:
                left = remaining(self._timeout, self._t0)
            except DeadlineExceeded:  # no time to ask it: this answer stands
                return
            owner = self._routing.attempt(self._items, left)
            self._owner = owner if owner.url is not None else None

    def failed(self, ask: IpcAsk, exc: BaseException) -> None:
        """The request raised `exc`: its acknowledgements given back; raised again unless the route goes on."""
        ask.transport.ipc_acks.restore(ask.tokens)
        if ask.transport is self._service:
            raise exc
        owner, self._owner = self._owner, None
        left = owner.failed(exc)  # raises when the fetch ends here
        if isinstance(exc, FALLBACK):  # forgotten: a "not here" naming it again is not followed
            self._given_up = owner.url
        if self.result is None:  # the owner known before: the Service now
            self._to_service, self._service_timeout = True, left
