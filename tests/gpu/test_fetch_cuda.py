"""Fetch into a CUDA `out` (client/destination.py): rows received into a reusable pinned staging buffer, one
host-to-device copy per segment, equal to the encode's own rows; the buffer is reused, not reallocated."""

from __future__ import annotations

import pytest
import torch

from encoder_service.client import AsyncEncoderClient, EncoderClient
from tests.support.images import image_bytes as png
from tests.support.service import running


@pytest.fixture(scope="module")
def cpu_service(request, tiny_checkpoint):
    return running(request, tiny_checkpoint("qwen3_vl"))


@pytest.mark.parametrize("kind", ["http", "grpc pickup", "grpc stream"])
def test_rows_land_on_the_gpu(cpu_service, kind):
    make = EncoderClient.http if kind == "http" else EncoderClient.grpc
    target = cpu_service.url if kind == "http" else cpu_service.grpc_address
    with make(target, timeout=30, **({"pickup": False} if kind == "grpc stream" else {})) as c:
        infos = c.encode([png(96, 64, 61), png(64, 64, 62)], return_embeddings=True)
        items = [(infos[0].id, 2), (infos[1].id, 4 + infos[0].num_tokens)]
        end = 4 + infos[0].num_tokens + infos[1].num_tokens
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.zeros(end - 1, infos[0].row_width, device="cuda", dtype=dtype)
            got = c.fetch(items, 1, end, out=out)
            assert got.rows is out
            assert torch.equal(out[1:1 + infos[0].num_tokens].cpu(), infos[0].embedding.to(dtype))
            assert torch.equal(out[-infos[1].num_tokens:].cpu(), infos[1].embedding.to(dtype))
        buffers = [id(b) for b in c._pinned._idle]
        c.fetch(items, 1, end, out=out)
        assert len(buffers) == 1 and c._pinned._idle[0].is_pinned()
        assert [id(b) for b in c._pinned._idle] == buffers  # reused, not reallocated


async def test_async_rows_land_on_the_gpu(cpu_service):
    async with AsyncEncoderClient.http(cpu_service.url, timeout=30) as c:
        (info,) = await c.encode([png(128, 64, 63)], return_embeddings=True)
        out = torch.zeros(info.num_tokens, info.row_width, device="cuda")
        await c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
        assert torch.equal(out.cpu(), info.embedding)
