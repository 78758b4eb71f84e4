"""A client on an address where no server answers, against real sockets on loopback: it says so at once (a
WARNING naming the address, while it goes on trying within the call's timeout, so a server that comes up on
that address in time serves the call), and a connect that gets no answer fails after the connect's own
deadline, not after the whole call's timeout (client/retry.py, client/http.py, rowpath/raw_http.py)."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from encoder_service import errors
from encoder_service.api.service import bind_socket
from encoder_service.client import EncoderClient
from tests.support.images import image_bytes
from tests.support.ports import free_port
from tests.support.service import RunningService, make_settings
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)
PNG = image_bytes(48, 48, seed=5101)


class Call(threading.Thread):
    """`fn()` on a thread of its own: its result or its exception when it ends."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self._fn, self.result, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self._fn()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc


def warnings_naming(caplog, address: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and address in r.getMessage()]


def test_a_refused_connect_is_said_at_once_and_the_call_goes_on_until_the_server_is_up(tiny_checkpoint, caplog):
    caplog.set_level(logging.WARNING, logger="encoder_service.client")
    port = free_port()  # nothing listens there yet: connects are refused
    url = f"http://127.0.0.1:{port}"
    with EncoderClient.http(url, timeout=90) as client:
        call = Call(lambda: client.encode([PNG], wait=True))
        wait_for(lambda: warnings_naming(caplog, f"127.0.0.1:{port}") or not call.is_alive(),
                 "a WARNING naming the address")
        assert call.is_alive(), f"the call ended before the server was up: {call.error!r}"
        (said,) = warnings_naming(caplog, f"127.0.0.1:{port}")
        assert "cannot reach" in said.getMessage() and "trying again within the call's timeout" in said.getMessage()
        server = RunningService(make_settings(tiny_checkpoint("qwen2_5_vl")), http_sock=bind_socket("127.0.0.1", port))
        try:
            call.join(90)
            assert not call.is_alive() and call.error is None, call.error
            assert call.result[0].num_tokens > 0
        finally:
            server.close()
    assert len(warnings_naming(caplog, f"127.0.0.1:{port}")) == 1  # once, not once per try


@pytest.fixture
def silent_address():
    """127.0.0.1:port whose connects get no answer: a listener with a backlog of 0 that never accepts, its
    one queued connection taken, so the kernel drops every further SYN (as a host that is gone, or a
    firewall, does)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=5)
    yield "127.0.0.1:%d" % listener.getsockname()[1]
    filler.close()
    listener.close()


@pytest.mark.parametrize("call", ["encode", "fetch"])  # through httpx, and on the raw fetch socket
def test_a_connect_that_gets_no_answer_ends_at_its_own_deadline(silent_address, call):
    with EncoderClient.http(f"http://{silent_address}", timeout=600, retry=None, connect_timeout_s=0.5) as client:
        run = Call(lambda: client.encode([PNG]) if call == "encode" else client.fetch([("x", 0)], 0, 1))
        run.join(30)  # far more than the connect's deadline, far less than the call's timeout
        assert not run.is_alive(), "the connect waited for the call's timeout"
    assert isinstance(run.error, errors.Unreachable), repr(run.error)
    assert f"cannot reach http://{silent_address}" in str(run.error) and "timed out" in str(run.error)
