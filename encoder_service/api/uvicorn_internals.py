"""What the service uses of uvicorn beyond its public API (`uvicorn.Config`, `uvicorn.Server.serve`), in one
place: which of its internals, and what happens where they are missing. pyproject.toml asks for uvicorn 0.29 or
later (`capture_signals` came in 0.29); the tests run with the version installed (0.54 when this was written).

  - `UvicornServer`, a `uvicorn.Server` overriding `capture_signals()` (a context manager around `serve`, 0.29
    on: the service stops HTTP and gRPC together on its own signals) and `startup(sockets)` (to set `listening`).
  - The httptools protocol's request cycle (uvicorn/protocols/http/httptools_impl.py: RequestResponseCycle),
    `RequestCycle` below: the ASGI `send` uvicorn hands the app is the cycle's bound method (its `__self__`);
    its `transport` is read (the pool threads write fetched rows on its socket, api/socket_send.py) and replaced
    for the length of an answer written in one write; `expected_content_length`, the body bytes uvicorn still
    expects, is lowered by what a thread wrote. `httptools_cycle_type()` checks once, at start-up, that
    uvicorn serves HTTP with httptools and that the cycle's `__init__` assigns both; otherwise (h11, another
    server, an in-process test client) no request has a cycle and rows go through ASGI, logged once
    (tests/service/test_socket_send.py fails on a uvicorn whose cycle lacks them).
  - The HTTP protocol `http="auto"` picks (httptools, else h11), subclassed by `http_protocol()` with what a
    subclass here reads of it (api/read_timeouts.py): `cycle` (None until a request's head is in) and its
    `response_complete`, `transport`, `loop` and `logger`, which both of uvicorn's protocols set. Not checked up
    front: without them every connection fails (AttributeError, logged by asyncio), as
    tests/service/test_read_timeouts.py would show.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator

import uvicorn


class UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling (the service stops HTTP and gRPC together) and with an
    event for "listening" so nobody polls `started`."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        self.listening.set()


def httptools_cycle_type() -> type | None:
    """uvicorn's httptools request cycle class, when uvicorn serves HTTP with it and it has what RequestCycle
    uses; else None (no request then has a cycle: `request_cycle` gives None)."""
    try:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    except ImportError:  # httptools not installed
        return None
    if AutoHTTPProtocol is not HttpToolsProtocol:
        return None
    probe = RequestResponseCycle.__init__.__code__.co_names
    return RequestResponseCycle if {"transport", "expected_content_length"} <= set(probe) else None


def request_cycle(send, cycle_type: type | None) -> RequestCycle | None:
    """The request cycle behind the ASGI `send` uvicorn gave the app, when it is of `cycle_type`
    (`httptools_cycle_type()`); None for any other `send`."""
    cycle = getattr(send, "__self__", None)
    return RequestCycle(cycle) if cycle_type is not None and type(cycle) is cycle_type else None


class RequestCycle:
    """One HTTP request's cycle in uvicorn's httptools protocol, through the two attributes used of it."""

    def __init__(self, cycle):
        self._cycle = cycle

    @property
    def transport(self) -> asyncio.Transport:
        """The connection's transport (its socket: `get_extra_info("socket")`)."""
        return self._cycle.transport

    @contextlib.contextmanager
    def transport_replaced(self, stand_in) -> Iterator[None]:
        """While inside, uvicorn writes this response through `stand_in` (which writes on to the transport)."""
        real = self._cycle.transport
        self._cycle.transport = stand_in
        try:
            yield
        finally:
            self._cycle.transport = real

    def sent_elsewhere(self, nbytes: int) -> None:
        """`nbytes` of the body went out on the socket past uvicorn: what it still expects drops by that much
        (else it would take the response's end for a short body)."""
        self._cycle.expected_content_length -= nbytes


@functools.cache
def http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (the one `http="auto"` picks: httptools, else h11) with what a subclass
    reads of it, by name; a subclass overrides asyncio.Protocol's callbacks and calls `super()`'s."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HttpProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def waiting_for_head(self) -> bool:
            # uvicorn makes a request's cycle once its head is in; a finished cycle waits for the next head.
            return self.cycle is None or self.cycle.response_complete

        def connection_closing(self) -> bool:
            return self.transport.is_closing()

        def close_connection(self) -> None:
            self.transport.close()

        def call_later(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
            return self.loop.call_later(delay_s, callback)

        def log_debug(self, message: str, *args) -> None:
            self.logger.debug(message, *args)  # uvicorn's own logger (uvicorn.error)

    return HttpProtocol
