"""The fetch by IPC across replicas (issue 38 item 6): two real `encoder-service serve` processes sharing a real
redis-server, each with its device row arena on the host stand-in (tests/support/standin_serve.py), and a
consumer on this host asking the replica that does not hold an id:

  - that replica answers at once "not here", naming the owner (its advertised address), with no segments: it
    pulls no rows from the owner (which would end the owner's pin: a delivered fetch) and reads none;
  - the client (client/base.py, client/owners.py) then asks the owner by IPC and gets the rows that way, bit
    for bit the socket fetch's, with no second row transfer; the owner's pin ends at the client's
    acknowledgement, sent to the owner that held the rows;
  - so does the vLLM connector's scheduler side (integrations/vllm/fetch.py): its hold is the owner's, the
    worker copies under it, and the acknowledgement goes to the owner;
  - an owner that goes silent (frozen) is asked by IPC within the owner's bound (client/owners.py: OWNER_S),
    given up, and the fetch goes to the Service (whose "not here" naming it again is not followed), then the
    next way: the client's and the vLLM fetcher's.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from encoder_service.client import EncoderClient
from encoder_service.integrations.vllm.fetch import RowFetcher
from encoder_service.integrations.vllm.ipc_loads import IpcLoader
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.staging import Need, StagingTable
from encoder_service.integrations.vllm.worker import IpcRows, RowLoader
from encoder_service.protocol.ipc import this_host
from encoder_service.testing.host_ipc import KIND, HostStandInReader
from tests.support.encoder_process import Replica, standin_entry, started
from tests.support.images import image_bytes
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(300)

WAIT_S = 30


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, shared_redis, tmp_path_factory):
    standin, logs = tmp_path_factory.mktemp("standin"), tmp_path_factory.mktemp("logs")
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    a, b = (Replica(name, checkpoint, shared_redis.url, logs, "--ipc-arena-bytes", "4MiB",
                    entry=standin_entry(standin)) for name in ("a", "b"))
    with started(a, b):
        yield a, b, standin


def sample(replica: Replica, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of the replica's /metrics (summed over the labels not given), 0 when absent."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()))


def counts(replica: Replica) -> dict[str, float]:
    """What says whether rows left the replica or a pin of it ended."""
    return {"rows_read": sample(replica, "encoder_fetch_rows_total"),
            "pins_ended": sample(replica, "encoder_cache_pins_ended_by_fetch_total"),
            "pinned": sample(replica, "encoder_cache_pinned_ids"),
            "peer_hits": sample(replica, "encoder_cache_hits_total", {"tier": "peer"}),
            "not_here": sample(replica, "encoder_ipc_fetches_total", {"outcome": "not_here"}),
            "held": sample(replica, "encoder_ipc_fetches_total", {"outcome": "held"})}


def encoded_on(a: Replica, seed: int):
    with EncoderClient.http(a.url, timeout=WAIT_S, ipc="off") as on_a:
        (info,) = on_a.encode([image_bytes(112, 84, seed=seed)], wait=True)
    assert info.owner == a.url
    return info


def test_the_replica_without_the_rows_answers_at_once_with_their_owner(pair):
    a, b, _ = pair
    info = encoded_on(a, seed=3801)
    a0, b0 = counts(a), counts(b)
    body = {"items": [{"id": info.id, "offset": 0}], "start": 0, "end": info.num_tokens, "timeout_s": WAIT_S,
            "ipc": {"host": this_host()}}
    answer = httpx.post(f"{b.url}/v1/fetch", json=body, timeout=WAIT_S).json()
    assert answer["ipc"]["owner"] == a.url and "not on this replica" in answer["ipc"]["unavailable"]
    assert answer["segments"] == [] and answer["num_rows"] == 0
    a1, b1 = counts(a), counts(b)
    assert a1 == a0  # nothing read from A, no pin of it ended: B pulled nothing
    assert b1["rows_read"] == b0["rows_read"] and b1["peer_hits"] == b0["peer_hits"]
    assert b1["not_here"] == b0["not_here"] + 1


def test_the_client_then_gets_the_rows_by_ipc_from_the_owner(pair):
    a, b, standin = pair
    info = encoded_on(a, seed=3802)
    a0, b0 = counts(a), counts(b)
    out = torch.full((info.num_tokens, info.row_width), float("nan"))
    with EncoderClient.http(b.url, timeout=WAIT_S, ipc=HostStandInReader(str(standin))) as c:
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
        assert c.fetch_paths == {"ipc": 1}
    a1, b1 = counts(a), counts(b)
    assert a1["rows_read"] - a0["rows_read"] == info.num_tokens  # one read of the rows: the owner's placement
    assert b1["rows_read"] == b0["rows_read"] and b1["peer_hits"] == b0["peer_hits"]  # B moved no rows
    assert (b1["not_here"] - b0["not_here"], a1["held"] - a0["held"]) == (1, 1)
    # The client's acknowledgement (sent on close) went to A, which held the rows: A's pin ended then.
    wait_for(lambda: counts(a)["pins_ended"] == a0["pins_ended"] + 1, "the owner's pin ended by the ack", WAIT_S)
    with EncoderClient.http(a.url, timeout=WAIT_S, ipc="off") as on_a:
        assert torch.equal(out, on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows)


def test_the_vllm_connector_holds_at_the_owner_too(pair):
    a, b, standin = pair
    info = encoded_on(a, seed=3803)
    a0, b0 = counts(a), counts(b)
    options = ConnectorOptions.from_extra_config({"url": b.url, "shm_dir": str(standin)})
    table = StagingTable(RowFetcher(options, info.row_width, ipc_kind=KIND))
    loader = RowLoader("cpu", None, ipc=IpcLoader(options, "cpu", reader=HostStandInReader(str(standin))))
    try:
        need = Need(info.id, info.id, info.num_tokens)
        wait_for(lambda: table.ensure("r1", [need]) or table.why("r1"), "the item staged", WAIT_S)
        assert table.why("r1") is None
        table.allocated("r1", need.identifier, need.num_rows)
        (load,) = table.end_step()
        assert isinstance(load.rows, IpcRows) and load.rows.hold.server == a.url
        rows = loader.load(load, info.row_width)
        assert not loader.ipc.client().fetch_paths  # copied under the scheduler side's hold, held at A
        table.fetcher.copied(loader.ipc.take_copied())
        wait_for(lambda: counts(a)["pins_ended"] == a0["pins_ended"] + 1, "A's pin ended by the ack", WAIT_S)
    finally:
        table.close()
        loader.close()
    b1 = counts(b)
    assert b1["rows_read"] == b0["rows_read"] and b1["peer_hits"] == b0["peer_hits"]
    with EncoderClient.http(a.url, timeout=WAIT_S, ipc="off") as on_a:
        assert torch.equal(rows, on_a.fetch([(info.id, 0)], 0, info.num_tokens).rows)


def test_a_frozen_owner_is_given_up_for_the_service(pair):
    """Before: the owner was asked by IPC with the caller's whole timeout (over its channel, that and 5 s more),
    and its silence, a plain timeout, failed the client's fetch instead of going to the Service; the vLLM
    fetcher asked the Service first every time and kept every owner it was sent to. (Last in this module: A
    is frozen for a while.)"""
    a, b, standin = pair
    info = encoded_on(a, seed=3810)
    n, width = info.num_tokens, info.row_width
    options = ConnectorOptions.from_extra_config({"url": b.url, "shm_dir": str(standin), "fetch_timeout_s": 20})
    fetcher = RowFetcher(options, width, ipc_kind=KIND)
    with EncoderClient.http(b.url, timeout=20, ipc=HostStandInReader(str(standin))) as c:
        try:
            reference = torch.full((n, width), float("nan"))
            c.fetch([(info.id, 0)], 0, n, out=reference)  # B names A, asked over its channel
            fetcher.drop(fetcher.fetch(info.id, n))  # the same: A is the item's owner from now on
            assert c.fetch_paths == {"ipc": 1}
            os.kill(a.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            fetcher.drop(fetcher.fetch(info.id, n))  # A silent: given up; B's answer, then staged or held there
            fetcher_s = time.monotonic() - t0
            t0 = time.monotonic()
            out = torch.full((n, width), float("nan"))
            c.fetch([(info.id, 0)], 0, n, out=out)  # the same for the client
            client_s = time.monotonic() - t0
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
            fetcher.close()
    assert torch.equal(out, reference) and c.fetch_paths["ipc"] >= 1
    assert fetcher._ipc_fetches.routed == {"direct": 1, "fallbacks": 1}
    assert client_s < 15 and fetcher_s < 15  # (the Service's fetch included: it takes the rows over)
