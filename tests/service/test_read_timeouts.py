"""Stalled HTTP connections against a real uvicorn server (--read-timeout-s 1): a connection that sends nothing,
half a request head, or a head and then only part of its body is closed after the timeout instead of held
for good (api/read_timeouts.py, api/bodies.py); a stalled body is answered 408 and counted as its own
outcome, not as a client that left (`cancelled`); so is a body trickling in under the timeout's pauses past
its deadline (the timeout plus its length at api/bodies.py's MIN_BODY_RATE)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.support.images import image_bytes
from tests.support.service import running

pytestmark = pytest.mark.timeout(120)
READ_TIMEOUT_S = 1.0
GIVE_UP_S = 20.0  # the test's own bound on waiting for the server to close (far above the timeout)


@pytest.fixture(scope="module")
def svc(request, tiny_checkpoint):
    return running(request, tiny_checkpoint("qwen2_5_vl"), "--read-timeout-s", str(READ_TIMEOUT_S), "--sglang-protocol")


def connect(svc, url: str | None = None) -> socket.socket:
    host, port = (url or svc.url).removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=GIVE_UP_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it does not, in
    GIVE_UP_S)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def requests_counted(svc, outcome: str) -> float:
    return svc.sample("encoder_requests_total", {"transport": "http", "method": "encode", "outcome": outcome})


@pytest.mark.parametrize("sent", [b"", b"POST /v1/encode HTTP/1.1\r\nhost: x\r\ncontent-le"],
                         ids=["nothing", "half a head"])
def test_a_connection_whose_request_head_does_not_come_is_closed(svc, sent):
    with connect(svc) as sock:
        sock.sendall(sent)
        assert read_until_closed(sock) == b""  # closed, nothing answered: no request was seen


def test_a_kept_alive_connection_whose_next_head_stalls_is_closed(svc):
    png = image_bytes(32, 32, seed=4401)
    head = (f"POST /v1/encode HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\ncontent-length: {len(png)}\r\n\r\n")
    with connect(svc) as sock:
        sock.sendall(head.encode() + png)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        sock.sendall(b"POST /v1/encode HTTP/1.1\r\n")  # the next request's first line, then nothing
        assert b"HTTP/1.1" not in read_until_closed(sock)


def test_a_body_cut_short_is_answered_408_and_not_counted_as_cancelled(svc):
    cancelled, timed_out = requests_counted(svc, "cancelled"), requests_counted(svc, "request_timeout")
    png = image_bytes(64, 64, seed=4402)
    head = (f"POST /v1/encode HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\ncontent-length: {len(png)}\r\n\r\n")
    with connect(svc) as sock:
        sock.sendall(head.encode() + png[:len(png) // 2])  # then nothing, the connection kept open
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"request_timeout" in answer and b"--read-timeout-s" in answer
    assert requests_counted(svc, "request_timeout") == timed_out + 1
    assert requests_counted(svc, "cancelled") == cancelled


def test_a_body_trickling_past_its_deadline_is_answered_408(svc):
    """A byte every 0.4 s never paused for --read-timeout-s: the connection was held, and the body buffered,
    for as long as the client liked. Its deadline is 1 s + 3 KB at 64 KiB/s here."""
    timed_out = requests_counted(svc, "request_timeout")
    png = image_bytes(32, 32, seed=4403)
    head = (f"POST /v1/encode HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\ncontent-length: {len(png)}\r\n\r\n")
    answered = threading.Event()
    with connect(svc) as sock:
        sock.sendall(head.encode())

        def trickle() -> None:
            for k in range(min(len(png), int(GIVE_UP_S / 0.4))):
                if answered.wait(0.4):
                    return
                try:
                    sock.sendall(png[k:k + 1])
                except OSError:  # closed by the server
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        t0 = time.monotonic()
        sender.start()
        try:
            answer = read_until_closed(sock)
        finally:
            answered.set()
            sender.join(GIVE_UP_S)
        answered_in = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"did not arrive within" in answer and b"KiB/s" in answer, answer[:600]
    assert answered_in < GIVE_UP_S / 2
    assert requests_counted(svc, "request_timeout") == timed_out + 1


def test_a_body_cut_short_on_the_sglang_port_is_answered_408_with_the_connection_closed(svc):
    """The SGLang port's 408 said nothing of the connection (api/http.py's says `connection: close`): the rest
    of the body, should it come, is no next request's bytes."""
    body = b'{"mm_items": ["aGk="], "req_id": "r", "num_parts": 1, "part_idx": 0}'
    head = f"POST /encode HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    with connect(svc, svc.sglang_url) as sock:
        sock.sendall(head.encode() + body[:10])
        answer = read_until_closed(sock)
    head_lines = answer.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert head_lines[0].startswith(b"http/1.1 408"), answer[:300]
    assert b"connection: close" in head_lines, answer[:300]
