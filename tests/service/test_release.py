"""Release of encode pins (POST /v1/release, Encoder.Release, client.release) against the real servers.

After a release the id's pin is gone (the store says so) and the entry is still fetchable while cached;
unknown ids count 0, malformed ones are answered as invalid with why while the others are released, the id
count is limited (4xx), auth applies.
"""

from __future__ import annotations

import grpc
import httpx
import pytest
import torch

from encoder_service import errors
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc
from tests.support.images import image_bytes as png
from tests.support.clients import async_client, sync_client

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]


def pinned(svc, public_id: str) -> bool:
    return svc.pinned(public_id)


def pinned_keys(svc) -> int:
    async def on_loop():
        return svc.core.store.stats()["local_pinned_keys"]

    return svc.call(on_loop)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_release_ends_the_pin_and_keeps_the_entry(service, transport):
    with sync_client(service, transport) as c:
        a, b = c.encode([png(112, 84, 60 + len(transport)), png(56, 56, 62 + len(transport))], return_embeddings=True)
        assert pinned(service, a.id) and pinned(service, b.id)
        keys = pinned_keys(service)
        assert c.release([a.id, a.id]) == 1  # one request pinned each distinct id once: released once
        assert not pinned(service, a.id) and pinned(service, b.id)
        assert pinned_keys(service) == keys - 1
        got = c.fetch([(a.id, 0)], 0, a.num_tokens)  # still cached: an ordinary LRU entry now
        assert torch.equal(got.rows, a.embedding)
        assert c.release([a.id]) == 0  # released already
        assert c.release(["f" * 32, "u:never-encoded"]) == 0  # unknown ids are not an error
        assert c.release([]) == 0
        assert c.release([b.id]) == 1 and not pinned(service, b.id)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_each_encode_holds_its_own_pin(service, transport):
    async with async_client(service, transport) as c:
        image = png(84, 84, 70 + len(transport))
        (first,) = await c.encode([image], wait=True)
        (second,) = await c.encode([image])  # a second holder of the same id
        assert first.id == second.id and second.cached
        assert await c.release([first.id]) == 1
        assert pinned(service, first.id)  # the other encode still holds it
        assert await c.release([first.id]) == 1
        assert not pinned(service, first.id)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_malformed_ids_are_answered_and_the_good_ones_released(service, transport):
    async with async_client(service, transport) as c:
        a, b = await c.encode([png(112, 56, 80 + len(transport)), png(56, 112, 82 + len(transport))])
        long_garbage = "x" * 5000
        got = await c.release(["not an id", a.id, "u:has space", "not an id", b.id + "#0", long_garbage,
                               "f" * 32])
        assert got == 1 and isinstance(got, int)  # `a` released; the unknown content id counts 0
        assert not pinned(service, a.id) and pinned(service, b.id)
        assert [i.id for i in got.invalid] == ["not an id", "u:has space", b.id + "#0", "x" * 200]
        reasons = [i.reason for i in got.invalid]
        assert reasons[0].startswith("malformed id 'not an id': not a 32-hex-digit content id")
        assert "malformed id 'u:has space'" in reasons[1] and "malformed id" in reasons[2]
        assert len(reasons[3]) < 400  # the id is cut in the reason too
        assert (await c.release([b.id])).invalid == ()
        assert not pinned(service, b.id)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bad_releases(service, auth_service, transport):
    from tests.support.service import AUTH_TOKEN

    async with async_client(service, transport) as c:
        limit = service.settings.limits.max_images * 16
        with pytest.raises(errors.InvalidInput, match=f"number of ids to release is {limit + 1}, over the limit"):
            await c.release(["f" * 32] * (limit + 1))
        with pytest.raises(errors.InvalidInput, match="list of ids"):
            await c.release("f" * 32)
        assert (await c.metadata())["family"]  # still serving
    async with async_client(auth_service, transport, token="nope") as c:
        with pytest.raises(errors.Unauthenticated):
            await c.release(["f" * 32])
    async with async_client(auth_service, transport, token=AUTH_TOKEN) as c:
        (info,) = await c.encode([png(56, 56, 72)])
        assert await c.release([info.id]) == 1


def test_release_http_body_checks(service):
    with httpx.Client(base_url=service.url, timeout=30) as h:
        for body in ({"ids": "f" * 32}, {"ids": [3]}, {"id": ["f" * 32]}, {}):
            r = h.post("/v1/release", json=body)
            assert r.status_code == 400 and r.json()["error"]["kind"] == "invalid_input", (body, r.text)
        r = h.post("/v1/release", content=b"ids=x", headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
        assert h.post("/v1/release", json={"ids": ["f" * 32]}).json() == {"released": 0, "invalid": []}
        r = h.post("/v1/release", json={"ids": ["f" * 32, "../x"]})
        assert r.status_code == 200 and r.json()["released"] == 0
        assert [i["id"] for i in r.json()["invalid"]] == ["../x"] and "malformed id" in r.json()["invalid"][0]["reason"]


async def test_release_grpc_status(service):
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        stub = pb_grpc.EncoderStub(channel)
        answer = await stub.Release(pb.ReleaseRequest(ids=["../x", "0" * 32]), timeout=30)
        assert answer.released == 0 and [i.id for i in answer.invalid] == ["../x"]
        assert "malformed id" in answer.invalid[0].reason
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            limit = service.settings.limits.max_images * 16
            await stub.Release(pb.ReleaseRequest(ids=["0" * 32] * (limit + 1)), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the limit" in exc.value.details()
