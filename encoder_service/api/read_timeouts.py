"""HTTP connections that stall while the server waits for a request are closed after --read-timeout-s.

uvicorn closes a keep-alive connection idle between requests (timeout_keep_alive), but waits without end for
a request's head (a connection that sends nothing, or half its headers) and for its body. So:
  - the head: `head_timeout_protocol(read_timeout_s)` is uvicorn's own HTTP protocol class (the one its
    `http="auto"` picks: httptools, else h11; api/uvicorn_internals.py: http_protocol) with a timer: a
    connection whose request head has not arrived `read_timeout_s` after the connection opened, or after the
    head's first byte, is closed. No request was seen, so none is counted;
  - the body: api/bodies.py's bounded reader raises RequestTimeout when no part of the body comes for
    `read_timeout_s`; it is answered 408 (kind `request_timeout`, its own outcome in encoder_requests_total,
    not `cancelled`) and the connection closed after that answer (api/http.py).
"""

from __future__ import annotations

import asyncio

from encoder_service.api.uvicorn_internals import http_protocol


def head_timeout_protocol(read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class whose connections wait at most `read_timeout_s` for a request head."""

    class HeadTimeoutProtocol(http_protocol()):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._await_head()

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            """Timed from the connection's opening, or the head's first byte; stopped once the head is in."""
            if not self.waiting_for_head():
                self._stop_head_timer()
            elif self._head_timer is None and not self.connection_closing():
                self._head_timer = self.call_later(read_timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.waiting_for_head() and not self.connection_closing():
                self.log_debug("closed a connection whose request head did not arrive in %gs", read_timeout_s)
                self.close_connection()

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

    return HeadTimeoutProtocol
