"""One caller id raced with two pictures to two real replicas sharing one real redis-server (issue 31, item 0).

Two `encoder-service serve` processes, A and B. For each pair, two threads released by one barrier send the
same new caller id at the same instant: picture X to A, picture Y (same size, other pixels) to B, over HTTP
(JSON `{"images": [{"id", "data"}]}`) or gRPC (`caller_id`), with and without `wait`. What must hold:

  - exactly one of the two is accepted; the other is 409 (Conflict), with and without `wait`;
  - the id's rows, fetched on either replica, are the accepted picture's (compared with the rows each
    picture gets under its own content id), and the losing replica never answers 409 to a fetch of the
    winner's id: a conflict is the request's failure, never the id's;
  - once Redis lost the id's binding (deleted, as an eviction would; or Redis restarted, empty) the replica
    holding the id writes it again, and the other picture is still refused under the id.
"""

from __future__ import annotations

import base64
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import torch

from encoder_service import errors
from encoder_service.cache import key_from_id
from encoder_service.replicas.directory import binding_name, location_name
from encoder_service.client import EncoderClient
from encoder_service.client.types import ImageSource
from tests.support.encoder_process import Replica, started
from tests.support.images import image_bytes
from tests.support.reference import rel_err
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(300)

PAIRS = 10  # per transport and wait mode
WAIT_S = 30.0


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint, shared_redis, tmp_path_factory):
    checkpoint, logs = tiny_checkpoint("qwen2_5_vl"), tmp_path_factory.mktemp("race-logs")
    with started(*(Replica(name, checkpoint, shared_redis.url, logs) for name in ("a", "b"))) as pair:
        yield pair


def encode_http(replica: Replica, caller_id: str, data: bytes, wait: bool) -> int:
    body = {"images": [{"id": caller_id, "data": base64.b64encode(data).decode()}], "wait": wait, "timeout_s": 30}
    return httpx.post(f"{replica.url}/v1/encode", json=body, timeout=WAIT_S).status_code


def encode_grpc(replica: Replica, caller_id: str, data: bytes, wait: bool) -> int:
    with EncoderClient.grpc(replica.grpc_address, timeout=WAIT_S) as client:
        try:
            client.encode([ImageSource(data=data, caller_id=caller_id)], wait=wait)
        except errors.Conflict:
            return 409
    return 200


def rows_of(replica: Replica, public_id: str, num_tokens: int) -> torch.Tensor:
    with EncoderClient.http(replica.url, timeout=WAIT_S) as client:
        return client.fetch([(public_id, 0)], 0, num_tokens).rows


def reference(replica: Replica, data: bytes) -> tuple[torch.Tensor, int]:
    """The picture's rows under its content id, and its token count."""
    with EncoderClient.http(replica.url, timeout=WAIT_S) as client:
        (info,) = client.encode([data], wait=True)
        return client.fetch([(info.id, 0)], 0, info.num_tokens).rows, info.num_tokens


def raced(a: Replica, b: Replica, caller_id: str, x: bytes, y: bytes, send, wait: bool) -> tuple[int, int]:
    """X to A and Y to B under `caller_id`, released together: their two statuses."""
    barrier = threading.Barrier(2)

    def one(replica: Replica, data: bytes) -> int:
        barrier.wait(WAIT_S)
        return send(replica, caller_id, data, wait)

    with ThreadPoolExecutor(2) as pool:
        on_a, on_b = pool.submit(one, a, x), pool.submit(one, b, y)
        return on_a.result(WAIT_S), on_b.result(WAIT_S)


def closest(rows: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str:
    """Which picture's rows `rows` are (they differ by far more than any rounding: other pixels)."""
    errs = {name: rel_err(rows, ref) for name, ref in candidates.items()}
    name = min(errs, key=errs.get)
    assert errs[name] < 1e-4, errs
    return name


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait"])
def test_one_caller_id_raced_with_two_pictures_names_one_of_them_everywhere(replicas, transport, wait):
    a, b = replicas
    send = encode_http if transport == "http" else encode_grpc
    for k in range(PAIRS):
        seed = 1000 * (transport == "grpc") + 100 * wait + k
        x, y = image_bytes(96, 64, seed=2 * seed), image_bytes(96, 64, seed=2 * seed + 1)
        refs = {"x": reference(a, x), "y": reference(a, y)}
        num_tokens = refs["x"][1]
        caller_id = f"race-{transport}-{wait}-{k}"
        statuses = raced(a, b, caller_id, x, y, send, wait)
        assert sorted(statuses) == [200, 409], (caller_id, statuses)
        winner = "x" if statuses[0] == 200 else "y"
        for replica in (a, b):  # the loser's replica too: the id is fine, only the losing request was not
            rows = rows_of(replica, f"u:{caller_id}", num_tokens)
            assert closest(rows, {n: r for n, (r, _) in refs.items()}) == winner, (caller_id, replica.url)


def test_a_binding_redis_lost_is_written_again_by_the_replica_holding_the_id(replicas, shared_redis, tiny_checkpoint):
    a, b = replicas
    x, y = image_bytes(96, 64, seed=7001), image_bytes(96, 64, seed=7002)
    assert encode_http(a, "kept", x, wait=True) == 200
    with httpx.Client(timeout=WAIT_S) as http:
        fp = http.get(f"{a.url}/v1/metadata").json()["fingerprint"]
    name = key_from_id("u:kept", fp).name
    with redis.Redis.from_url(shared_redis.url) as direct:
        assert direct.get(binding_name(name)) is not None
        direct.delete(binding_name(name), name)  # evicted: binding and rows
        wait_for(lambda: direct.get(binding_name(name)) is not None, "A to bind its id again", WAIT_S)
    assert encode_http(b, "kept", y, wait=True) == 409
    # Redis restarted, empty: A binds its ids again (B's encode meanwhile is refused with 503 and retried by
    # the client, or refused with 409 once A's binding is back), never accepted.
    shared_redis.restart()
    with redis.Redis.from_url(shared_redis.url) as direct:
        wait_for(lambda: direct.get(binding_name(name)) is not None, "A to bind its id again after the restart",
                 WAIT_S)
    assert encode_grpc(b, "kept", y, wait=True) == 409
    rows, n = reference(a, x)
    assert torch.equal(rows_of(b, "u:kept", n), rows)


def encode_retried(replica: Replica, caller_id: str, data: bytes) -> None:
    """As the project's clients encode: a 503 (Redis restarted moments ago) is tried again."""
    with EncoderClient.http(replica.url, timeout=WAIT_S) as client:
        client.encode([ImageSource(data=data, caller_id=caller_id)], wait=True)


def caller_name(replica: Replica, caller_id: str) -> str:
    with httpx.Client(timeout=WAIT_S) as http:
        fp = http.get(f"{replica.url}/v1/metadata").json()["fingerprint"]
    return key_from_id(f"u:{caller_id}", fp).name


def assert_rows_everywhere(replicas, caller_id: str, data: bytes) -> None:
    rows, n = reference(replicas[0], data)
    for replica in replicas:
        assert torch.equal(rows_of(replica, f"u:{caller_id}", n), rows), replica.url


def test_other_bytes_right_after_redis_evicted_the_binding_are_refused(replicas, shared_redis):
    """Before: the binding was a SET NX of its own key, so once Redis evicted it another picture under the id
    was accepted on B (while A held the first one's rows) until A's periodic rebind; A then dropped its own
    entry, and the first caller read the other picture's rows. Now the binding is decided with what Redis
    still has of the id: its location carries the content tag of the rows A holds."""
    a, b = replicas
    for k in range(3):
        x, y = image_bytes(96, 64, seed=7101 + 2 * k), image_bytes(96, 64, seed=7102 + 2 * k)
        caller_id = f"evicted-binding-{k}"
        encode_retried(a, caller_id, x)
        with redis.Redis.from_url(shared_redis.url) as direct:
            assert direct.delete(binding_name(caller_name(a, caller_id))) == 1  # evicted: the binding alone
        assert encode_http(b, caller_id, y, wait=False) == 409  # refused before it is admitted
        assert_rows_everywhere(replicas, caller_id, x)


def test_other_bytes_right_after_a_redis_restart_are_never_accepted(replicas, shared_redis):
    """Before: a replica that had not noticed the restart yet (its heartbeat looks once a second) bound the id
    to the other picture on the empty Redis: 200, and the first caller then read the other picture's rows.
    Now a binding on a Redis node the replica has not seen is refused (503, retried by the project's clients)
    until the replicas holding ids have written theirs again: then the other picture is a 409."""
    a, b = replicas
    x, y = image_bytes(96, 64, seed=7201), image_bytes(96, 64, seed=7202)
    encode_retried(a, "restarted", x)
    shared_redis.restart()
    statuses = [encode_http(b, "restarted", y, wait=True)]  # at once: B has not looked at Redis since
    wait_for(lambda: statuses.append(encode_http(b, "restarted", y, wait=True)) or statuses[-1] != 503,
             "B to answer other than 503", WAIT_S)
    assert set(statuses) <= {503, 409} and statuses[-1] == 409, statuses
    assert_rows_everywhere(replicas, "restarted", x)


def test_a_binding_found_wrong_by_its_holder_retires_the_id_everywhere(replicas, shared_redis):
    """Redis lost everything about an id A holds (its binding and location), and B accepted other bytes under
    it before A wrote its binding again: two contents under one id on two replicas. A, checking its bindings,
    retires the id: every replica drops it, and from then on neither picture's rows are served under it (a
    404), nor is it accepted again (409)."""
    a, b = replicas
    x, y = image_bytes(96, 64, seed=7301), image_bytes(96, 64, seed=7302)
    refs = {"x": reference(a, x)[0], "y": reference(a, y)[0]}
    encode_retried(a, "twice", x)
    name = caller_name(a, "twice")
    with redis.Redis.from_url(shared_redis.url) as direct:
        direct.delete(binding_name(name), location_name(name))  # everything Redis had of the id
        accepted = encode_http(b, "twice", y, wait=True) == 200  # 409 if A wrote its binding again first
        if accepted:
            wait_for(lambda: direct.get(binding_name(name)) == b"retired", "A to retire the id", WAIT_S)
    for replica in replicas:
        if accepted:  # both drop it at their next binding check
            wait_for(lambda replica=replica: named_by(replica, "twice", refs) == "missing",
                     f"{replica.url} to drop the id", WAIT_S)
        else:
            assert named_by(replica, "twice", refs) == "x"
    assert encode_http(b, "twice", y, wait=True) == 409


def named_by(replica: Replica, caller_id: str, refs: dict[str, torch.Tensor]) -> str:
    """Which picture of `refs` `u:<caller_id>` names on `replica`, or "missing" (404)."""
    n = next(iter(refs.values())).shape[0]
    try:
        return closest(rows_of(replica, f"u:{caller_id}", n), refs)
    except errors.NotFound:
        return "missing"
