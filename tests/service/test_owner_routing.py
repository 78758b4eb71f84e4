"""Fetches straight to the replica holding the rows (client/owners.py), against two real replicas sharing a
real redis-server behind a round-robin TCP forwarder (a Kubernetes Service without affinity:
tests/support/forwarder.py):

  - encode answers name the owner (the answering replica's advertised address); the client fetches there
    directly, bit for bit the rows the Service path gives, and the other replica serves none of it;
  - `follow_owner=False`: every fetch goes through the Service (and any replica answers it);
  - an owner that cannot be reached, or does not answer (issue 38: frozen, hung, its packets dropped), is
    given up for the Service, with no error to the caller; without waiting on its transport's pending
    acknowledgements; and a silent owner that uses up the caller's timeout is a timeout (504), not a Service
    that "cannot be reached".
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from encoder_service import errors
from encoder_service.client import AsyncEncoderClient, EncoderClient
from encoder_service.client import ipc as client_ipc
from encoder_service.client.owners import OWNER_S
from tests.support.blackhole import Blackhole
from tests.support.forwarder import Forwarder
from tests.support.images import image_bytes
from tests.support.ports import free_port
from tests.support.service import running

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30


@pytest.fixture(scope="module")
def service(request, tiny_checkpoint, shared_redis):
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    replicas = [running(request, checkpoint, "--redis-url", shared_redis.url) for _ in range(2)]
    forwarder = Forwarder([(r.url.removeprefix("http://").rsplit(":", 1)[0], int(r.url.rsplit(":", 1)[1]))
                           for r in replicas])
    request.addfinalizer(forwarder.close)
    return forwarder, replicas


def fetches(svc) -> float:
    return svc.sample("encoder_requests_total", {"transport": "http", "method": "fetch", "outcome": "ok"})


def test_fetches_go_straight_to_the_owner(service):
    forwarder, replicas = service
    datas = [image_bytes(64, 48, seed=6100 + k) for k in range(4)]
    with EncoderClient.http(forwarder.url, timeout=WAIT_S) as client, \
            EncoderClient.http(forwarder.url, timeout=WAIT_S, follow_owner=False) as via_service:
        infos = client.encode(datas, wait=True)
        owner = next(r for r in replicas if r.url == infos[0].owner)
        other = next(r for r in replicas if r is not owner)
        assert {i.owner for i in infos} == {owner.url}
        before = fetches(owner), fetches(other)
        direct = [client.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
        assert (fetches(owner) - before[0], fetches(other) - before[1]) == (len(infos), 0)
        assert client._transport._transport.routed == {"direct": len(infos), "fallbacks": 0}
        through = [via_service.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
    assert all(torch.equal(x, y) for x, y in zip(direct, through))


async def test_the_async_client_goes_straight_to_the_owner_too(service):
    forwarder, replicas = service
    async with AsyncEncoderClient.http(forwarder.url, timeout=WAIT_S) as client:
        (info,) = await client.encode([image_bytes(64, 48, seed=6200)], wait=True)
        owner = next(r for r in replicas if r.url == info.owner)
        before = fetches(owner)
        await client.fetch([(info.id, 0)], 0, info.num_tokens)
        assert fetches(owner) - before == 1


def test_an_owner_that_cannot_be_reached_is_given_up_for_the_service(request, tiny_checkpoint, shared_redis):
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    svc = running(request, tiny_checkpoint("qwen2_5_vl"), "--redis-url", shared_redis.url, "--advertise-url", gone)
    with EncoderClient.http(svc.url, timeout=WAIT_S) as client:
        (info,) = client.encode([image_bytes(64, 48, seed=6300)], wait=True)
        assert info.owner == gone
        rows = client.fetch([(info.id, 0)], 0, info.num_tokens).rows  # tried there, then the Service
        again = client.fetch([(info.id, 0)], 0, info.num_tokens).rows  # the Service at once
        assert client._transport._transport.routed == {"direct": 0, "fallbacks": 1}
    assert torch.equal(rows, again)


@pytest.mark.parametrize("silence", ["silent", "dropping"])
def test_an_owner_that_does_not_answer_is_given_up_for_the_service(request, tiny_checkpoint, shared_redis, silence):
    """Before: the fetch waited its whole timeout on the owner and failed 504 (DeadlineExceeded was no reason to
    ask the Service)."""
    with Blackhole(silence) as hole:
        svc = running(request, tiny_checkpoint("qwen2_5_vl"), "--redis-url", shared_redis.url,
                      "--advertise-url", hole.url)
        with EncoderClient.http(svc.url, timeout=WAIT_S) as client:
            (info,) = client.encode([image_bytes(64, 48, seed=6400)], wait=True)
            assert info.owner == hole.url
            t0 = time.monotonic()
            rows = client.fetch([(info.id, 0)], 0, info.num_tokens).rows  # tried there, then the Service
            answered_in = time.monotonic() - t0
            again = client.fetch([(info.id, 0)], 0, info.num_tokens).rows  # the Service at once
            assert client._transport._transport.routed == {"direct": 0, "fallbacks": 1}
    assert answered_in < OWNER_S + 2.0
    assert torch.equal(rows, again)


def test_a_silent_owner_that_uses_up_the_timeout_is_a_timeout(request, tiny_checkpoint, shared_redis, caplog):
    """Before: what was left of a caller's timeout of <= OWNER_S after the owner's try (0) reached the Service's
    socket as non-blocking mode: "cannot reach" the Service (a WARNING), Unreachable (503), not a 504."""
    with Blackhole("silent") as hole:
        svc = running(request, tiny_checkpoint("qwen2_5_vl"), "--redis-url", shared_redis.url,
                      "--advertise-url", hole.url)
        with EncoderClient.http(svc.url, timeout=WAIT_S) as client:
            (info,) = client.encode([image_bytes(64, 48, seed=6500)], wait=True)
            client.timeout = 1.0
            with caplog.at_level(logging.WARNING, "encoder_service.client"), \
                    pytest.raises(errors.DeadlineExceeded):
                client.fetch([(info.id, 0)], 0, info.num_tokens)
    assert not any("cannot reach" in r.getMessage() for r in caplog.records)


def test_an_owner_given_up_does_not_hold_up_the_fetch_with_its_acknowledgements(request, tiny_checkpoint,
                                                                                 shared_redis, monkeypatch):
    """Before: giving an owner up closed its transport inline, which first sent its pending acknowledgements to
    the dead owner (a connect of up to 5 s to a host dropping packets) before the Service was asked."""
    monkeypatch.setattr(client_ipc, "ACK_DELAY_S", 60.0)  # a token waits for a fetch to carry it
    with Blackhole("dropping") as hole:
        svc = running(request, tiny_checkpoint("qwen2_5_vl"), "--redis-url", shared_redis.url,
                      "--advertise-url", hole.url)
        with EncoderClient.http(svc.url, timeout=WAIT_S) as client:
            (info,) = client.encode([image_bytes(64, 48, seed=6600)], wait=True)
            routing = client._transport._transport
            attempt = routing.attempt([(info.id, 0)], WAIT_S)  # the owner's transport, with a hold's token
            attempt.transport.ipc_acks.add("ab" * 16)
            attempt.succeeded()
            t0 = time.monotonic()
            rows = client.fetch([(info.id, 0)], 0, info.num_tokens).rows  # tried there, then the Service
            answered_in = time.monotonic() - t0
            assert routing.routed == {"direct": 1, "fallbacks": 1}
    assert answered_in < OWNER_S + 2.0 and rows.shape[0] == info.num_tokens
