"""The clients' retries (client/retry.py, issue 22 item 5) against a real HTTP server on loopback that answers
what the test scripts (a 503 while Redis is away from a replica, a 400, then the answer), and a port with
nothing listening: 503 / UNAVAILABLE and an unreachable server are tried again within the caller's timeout,
nothing else is, and the vLLM connector's fetcher (built on the client) gets the same retries."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from encoder_service import errors
from encoder_service.client import AsyncEncoderClient, EncoderClient, RetryPolicy, retry
from encoder_service.integrations.vllm.fetch import RowFetcher
from encoder_service.integrations.vllm.options import ConnectorOptions
from tests.support.ports import free_port

METADATA = {"row_width": 48, "dtype": "bfloat16", "family": "qwen2_5_vl", "layout": "main", "shm_fetch": False}
FAST = RetryPolicy(tries=6, first_backoff_s=0.01, max_backoff_s=0.05)


@contextlib.contextmanager
def scripted(*answers: tuple[int, dict]):
    """A server answering GET /v1/metadata with `answers` in turn (the last one from then on); yields the list
    of the requests it got."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answers[min(len(seen), len(answers) - 1)]
            seen.append(self.path)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def unavailable(message: str = "Redis is unreachable: retry") -> tuple[int, dict]:
    return 503, {"error": {"kind": "unavailable", "message": message}}


def test_pauses_are_jittered_and_capped():
    policy = RetryPolicy(first_backoff_s=0.1, max_backoff_s=0.4)
    pauses = list(itertools.islice(policy.pauses(random.Random(1)), 7))
    caps = [0.1, 0.2, 0.4, 0.4, 0.4, 0.4, 0.4]
    assert all(0 <= p < cap for p, cap in zip(pauses, caps))
    assert len(set(pauses)) == 7  # jittered
    with pytest.raises(ValueError):
        RetryPolicy(tries=0)


def test_a_503_is_retried_until_it_answers():
    with scripted(unavailable(), unavailable(), (200, METADATA)) as (url, seen):
        with EncoderClient.http(url, timeout=10, retry=FAST) as client:
            assert client.metadata()["row_width"] == 48
        assert len(seen) == 3
    with scripted(unavailable(), (200, METADATA)) as (url, seen):
        with EncoderClient.http(url, timeout=10, retry=None) as client:  # retries off: the caller sees it
            with pytest.raises(errors.Unavailable, match="Redis is unreachable"):
                client.metadata()
        assert len(seen) == 1


def test_async_client_retries_too():
    async def metadata(url: str) -> dict:
        async with AsyncEncoderClient.http(url, timeout=10, retry=FAST) as client:
            return await client.metadata()

    with scripted(unavailable(), unavailable(), (200, METADATA)) as (url, seen):
        assert asyncio.run(metadata(url))["row_width"] == 48
        assert len(seen) == 3


def test_errors_another_try_would_repeat_are_raised_at_once():
    for answer, error in [((400, {"error": {"kind": "invalid_input", "message": "bad"}}), errors.InvalidInput),
                          ((429, {"error": {"kind": "overloaded", "message": "full"}}), errors.Overloaded),
                          ((404, {"error": {"kind": "not_found", "message": "unknown id"}}), errors.NotFound)]:
        with scripted(answer, (200, METADATA)) as (url, seen):
            with EncoderClient.http(url, timeout=10, retry=FAST) as client, pytest.raises(error):
                client.metadata()
            assert len(seen) == 1


def test_retries_stay_inside_the_callers_timeout():
    with scripted(unavailable()) as (url, seen):  # never recovers
        with EncoderClient.http(url, timeout=2.0, retry=RetryPolicy(tries=2, first_backoff_s=0.05,
                                                                    max_backoff_s=0.1)) as client:
            t0 = time.monotonic()
            with pytest.raises(errors.Unavailable):
                client.metadata()
            assert time.monotonic() - t0 < 2.0 + 2.0  # the deadline ends the tries
        assert len(seen) > 2  # with a timeout, as many tries as fit in it
    with scripted(unavailable()) as (url, seen):
        with EncoderClient.http(url, timeout=None, retry=RetryPolicy(tries=3, first_backoff_s=0.01,
                                                                     max_backoff_s=0.02)) as client:
            with pytest.raises(errors.Unavailable):
                client.metadata()
        assert len(seen) == 3  # without one, `tries` of them
    with EncoderClient.http(f"http://127.0.0.1:{free_port()}", timeout=0.3, retry=FAST) as client:
        with pytest.raises(errors.Unreachable, match="cannot reach"):  # nothing listening: tried, then
            client.metadata()


def test_no_retry_starts_with_less_than_min_try_s_of_the_timeout_left():
    """A try started with a sliver of the caller's timeout could only time out, and the caller would see a
    timeout where the server never answered but 503 (an encoder down: the vLLM proxy's 503 became a 504 on a
    loaded CI machine): the tries stop while MIN_TRY_S of the timeout is still left."""
    timeout = 1.0
    with scripted(unavailable()) as (url, seen):
        with EncoderClient.http(url, timeout=timeout, retry=RetryPolicy(tries=2, first_backoff_s=0.01,
                                                                        max_backoff_s=0.02)) as client:
            t0 = time.monotonic()
            with pytest.raises(errors.Unavailable):
                client.metadata()
            elapsed = time.monotonic() - t0
    assert len(seen) > 2
    assert elapsed <= timeout - retry.MIN_TRY_S + 0.15, elapsed  # (without the rule: within a pause of 1.0)


def test_the_vllm_connectors_fetcher_retries_through_the_client():
    with scripted(unavailable(), unavailable(), (200, METADATA)) as (url, seen):
        fetcher = RowFetcher(ConnectorOptions(url, shm="off", fetch_timeout_s=10))
        try:
            assert fetcher.metadata()["row_width"] == 48
        finally:
            fetcher.close()
        assert len(seen) == 3
