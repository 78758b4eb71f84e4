"""Fetch into a CUDA `out` (client/destination.py): rows received into a reusable pinned staging buffer, one
host-to-device copy per segment, equal to the encode's own rows; the buffer is reused, not reallocated, and a
fetch larger than the ones before gets a buffer that fits (the first GPU run of benchmarks/transfer_bench.py
failed there: a 28.8 MB fetch, then a 66.8 MB one). Shared memory to CUDA: a staging file, then one copy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from encoder_service.client import AsyncEncoderClient, EncoderClient
from encoder_service.client import base as client_base
from encoder_service.client import destination
from tests.support.images import image_bytes as png
from tests.support.service import running

KINDS = ["http", "grpc pickup", "grpc stream", "http shm", "grpc shm"]


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def cpu_service(request, tiny_checkpoint, shm_dir):
    return running(request, tiny_checkpoint("qwen3_vl"), "--shm-fetch", "--shm-dir", str(shm_dir))


def _client(svc, kind: str, shm_dir, **kw) -> EncoderClient:
    if kind == "grpc stream":
        kw["pickup"] = False
    if kind.endswith("shm"):
        kw |= {"shm": True, "shm_dir": str(shm_dir)}
    return EncoderClient.http(svc.url, timeout=30, **kw) if kind.startswith("http") else \
        EncoderClient.grpc(svc.grpc_address, timeout=30, **kw)


@pytest.mark.parametrize("kind", KINDS[:3])
def test_rows_land_on_the_gpu(cpu_service, shm_dir, kind):
    with _client(cpu_service, kind, shm_dir) as c:
        infos = c.encode([png(96, 64, 61), png(64, 64, 62)], return_embeddings=True)
        items = [(infos[0].id, 2), (infos[1].id, 4 + infos[0].num_tokens)]
        end = 4 + infos[0].num_tokens + infos[1].num_tokens
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.zeros(end - 1, infos[0].row_width, device="cuda", dtype=dtype)
            got = c.fetch(items, 1, end, out=out)
            assert got.rows is out
            assert torch.equal(out[1:1 + infos[0].num_tokens].cpu(), infos[0].embedding.to(dtype))
            assert torch.equal(out[-infos[1].num_tokens:].cpu(), infos[1].embedding.to(dtype))
        kept = [id(b) for b in c._staging_buffers.idle()]
        c.fetch(items, 1, end, out=out)
        assert len(kept) == 1 and c._staging_buffers.idle()[0].is_pinned()
        assert [id(b) for b in c._staging_buffers.idle()] == kept  # reused, not reallocated


@pytest.mark.parametrize("split", [False, True], ids=["one stream", "split"])
@pytest.mark.parametrize("kind", KINDS)
def test_fetches_that_grow_and_shrink_land_on_the_gpu(cpu_service, shm_dir, kind, split, monkeypatch):
    """Sizes change between fetches (one at a time, then from threads at once): every fetch's rows right,
    every staging buffer pinned, the idle ones bounded."""
    monkeypatch.setattr(destination, "STAGING_ROUND_BYTES", 4096)  # tiny rows: sizes apart get buffers apart
    if split:
        monkeypatch.setattr(client_base, "SPLIT_BYTES", 1)
    with _client(cpu_service, kind, shm_dir, fetch_streams=3) as c:
        small, large = c.encode([png(32, 32, 64), png(128, 96, 65)], return_embeddings=True)
        assert large.num_tokens >= 3 * small.num_tokens

        def fetch(info) -> None:
            out = torch.zeros(info.num_tokens, info.row_width, device="cuda", dtype=torch.bfloat16)
            assert c.fetch([(info.id, 0)], 0, info.num_tokens, out=out).rows is out
            assert torch.equal(out.cpu(), info.embedding.to(torch.bfloat16))

        for info in (small, large, large, small, large):
            fetch(info)
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(fetch, [small, large] * 6))
        idle = c._staging_buffers.idle()
        assert len(idle) <= destination.STAGING_IDLE and all(b.is_pinned() for b in idle)
        assert (len(idle) == 0) == kind.endswith("shm")  # shm stages in its own files


async def test_async_rows_land_on_the_gpu(cpu_service):
    async with AsyncEncoderClient.http(cpu_service.url, timeout=30) as c:
        (info,) = await c.encode([png(128, 64, 63)], return_embeddings=True)
        out = torch.zeros(info.num_tokens, info.row_width, device="cuda")
        await c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
        assert torch.equal(out.cpu(), info.embedding)
