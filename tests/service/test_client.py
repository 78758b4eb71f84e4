"""The Python clients (blocking and asyncio, HTTP and gRPC) against the real servers (tests/support/service.py).

iter_chunks must yield, per prompt chunk, exactly the rows of the images overlapping it (fetching only
those), equal to slices of the whole embedding.
"""

from __future__ import annotations

import pytest
import torch

from encoder_service import errors
from encoder_service.client import EncoderClient, PromptLayout
from encoder_service.ranges import chunks, plan_chunk
from encoder_service.rowpath.host_pool import PAGE, HostRowPool
from tests.support.images import image_bytes as png
from tests.support.layouts import prompt_layout
from tests.support.images import noise_image as pil_image

from tests.support.clients import async_client, sync_client
from tests.support.waits import async_wait_for

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]


class FetchSpy:
    """Wraps a transport and records what each fetch asked for."""

    def __init__(self, transport):
        self.inner, self.calls = transport, []

    def fetch(self, items, start, end, out, timeout):
        self.calls.append((start, end, [i for i, _ in items]))
        return self.inner.fetch(items, start, end, out, timeout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def layout_of(infos) -> PromptLayout:
    return prompt_layout(infos, lead=4, gap=3, tail=6)


def check_chunks(got, layout: PromptLayout, full: dict, chunk_size: int) -> None:
    assert [(c.start, c.end) for c in got] == chunks(layout.prompt_len, chunk_size)
    for chunk in got:
        expected = plan_chunk(layout.items, chunk.start, chunk.end)
        assert chunk.segments == expected
        if not expected:
            assert chunk.rows is None
            continue
        assert torch.equal(chunk.rows, torch.cat([full[s.id][s.row_start:s.row_end] for s in expected]))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_client(service, transport, tmp_path):
    path = tmp_path / "photo.png"
    path.write_bytes(png(112, 84, 1))
    with sync_client(service, transport) as c:
        # bytes, a path (str), a PIL image
        infos = c.encode([png(224, 224, 2), str(path), pil_image(56, 112, 3)], return_embeddings=True)
        full = {i.id: i.embedding for i in infos}
        assert all(full[i.id].shape == (i.num_tokens, i.row_width) for i in infos)
        again = c.encode([path])  # a Path; already encoded: cached, same id
        assert again[0].id == infos[1].id and again[0].cached and again[0].embedding is None
        layout = layout_of(infos)
        c._transport = spy = FetchSpy(c._transport)
        for chunk_size in (5, 16, 1000):
            spy.calls.clear()
            got = list(c.iter_chunks(layout, chunk_size))
            check_chunks(got, layout, full, chunk_size)
            # one request per chunk with images, naming only the images overlapping it
            assert spy.calls == [(g.start, g.end, [s.id for s in g.segments]) for g in got if g.segments]
        assert c.metadata()["family"] == "qwen2_5_vl"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_client(service_qwen3, transport):
    async with async_client(service_qwen3, transport) as c:
        infos = await c.encode([png(256, 256, 4), png(64, 96, 5), png(128, 64, 6)], return_embeddings=True)
        full = {i.id: i.embedding for i in infos}
        assert infos[0].layout == "main+deepstack3" and infos[0].row_width == 4 * infos[0].hidden_size
        layout = layout_of(infos)
        for chunk_size in (3, 40):
            got = [chunk async for chunk in c.iter_chunks((list(layout.items), layout.prompt_len), chunk_size)]
            check_chunks(got, layout, full, chunk_size)
        assert (await c.metadata())["layout"] == "main+deepstack3"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_iter_chunks_into_the_callers_buffer(service, transport):
    with sync_client(service, transport) as c:
        infos = c.encode([png(168, 112, 7), png(56, 56, 8)], return_embeddings=True)
        full = {i.id: i.embedding for i in infos}
        layout = layout_of(infos)
        width = infos[0].row_width
        embeds = torch.zeros(layout.prompt_len, width)  # the LLM's input-embeddings for the whole prompt
        for chunk in c.iter_chunks(layout, 7, out=lambda s, e: embeds[s:e]):
            assert chunk.rows is None or chunk.rows.data_ptr() == embeds[chunk.start:].data_ptr()
        expected = torch.zeros_like(embeds)
        for i, o, n in layout.items:
            expected[o:o + n] = full[i]
        assert torch.equal(embeds, expected)
        # a float16 buffer (cast on the way in) works too
        half = torch.zeros(10, width, dtype=torch.float16)
        item = layout.items[0]
        c.fetch([item], item[1], item[1] + 10, out=half)
        assert torch.equal(half[:item[2]], full[item[0]][:10].half())


@pytest.mark.parametrize("transport", TRANSPORTS + ["grpc, rows on the stream"])
def test_rows_fetched_without_out_reuse_the_memory_of_rows_the_caller_dropped(service, transport):
    kw = {"pickup": False} if transport.endswith("stream") else {}
    with sync_client(service, transport.split(",")[0], **kw) as c:
        c._row_pool = HostRowPool(min_bytes=PAGE)  # the rows here are small: pool them all
        (info,) = c.encode([png(224, 168, 9)], wait=True, return_embeddings=True)
        assert info.embedding.numel() * info.embedding.element_size() > PAGE
        for _ in range(2):
            rows = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
            assert torch.equal(rows, info.embedding)
            kept = rows[1:3]
            del rows
            held = c.fetch([(info.id, 0)], 0, info.num_tokens).rows  # `kept` is the caller's: other memory
            assert torch.equal(held, info.embedding) and torch.equal(kept, info.embedding[1:3])
            del held, kept
        assert c._row_pool.taken == {"reused": 2, "fresh": 2, "small": 0}


async def test_the_async_client_reuses_rows_memory_too(service):
    """Its reads run on a thread, which lets go of the rows a moment after the call returns: waited for."""
    async with async_client(service, "http") as c:
        c._row_pool = HostRowPool(min_bytes=PAGE)
        (info,) = await c.encode([png(224, 168, 9)], wait=True, return_embeddings=True)
        for _ in range(3):
            fetched = await c.fetch([(info.id, 0)], 0, info.num_tokens)
            assert torch.equal(fetched.rows, info.embedding)
            del fetched
            await async_wait_for(lambda: c._row_pool.stats()["idle_mappings"] == 1, "the rows' memory back", 10)
        assert c._row_pool.taken == {"reused": 2, "fresh": 1, "small": 0}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_errors_map_to_the_same_types_on_both_transports(service, auth_service, transport):
    from tests.support.service import AUTH_TOKEN

    async with async_client(service, transport) as c:
        with pytest.raises(errors.InvalidInput, match="image 0: not an image"):
            await c.encode([b"GIF89a not really"])
        with pytest.raises(errors.NotFound, match="unknown id"):
            await c.fetch([("f" * 32, 0)], 0, 4)
        with pytest.raises(errors.InvalidInput, match="malformed id"):
            await c.fetch([("not an id", 0)], 0, 4)
        (info,) = await c.encode([png(56, 56, 10)])
        with pytest.raises(errors.InvalidInput, match="end must be > start"):
            await c.fetch([(info.id, 0)], 4, 4)
        with pytest.raises(errors.InvalidInput, match="can't send an image of type int"):
            await c.encode([3])
    async with async_client(auth_service, transport, token="nope") as c:
        with pytest.raises(errors.Unauthenticated, match="wrong bearer token"):
            await c.encode([png(56, 56, 9)])
    async with async_client(auth_service, transport, token=AUTH_TOKEN) as c:
        (info,) = await c.encode([png(56, 56, 9)], wait=True)
        assert info.num_tokens > 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unreachable_server_is_unavailable(transport):
    from tests.support.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    c = EncoderClient.http(f"http://{address}", timeout=5) if transport == "http" else \
        EncoderClient.grpc(address, timeout=5)
    with c, pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
        c.metadata()


def test_bad_layouts_are_refused_before_any_request(service):
    with sync_client(service, "grpc") as c:
        with pytest.raises(errors.InvalidInput, match="ends past the prompt"):
            list(c.iter_chunks(([("a", 5, 10)], 12), 4))
        with pytest.raises(errors.InvalidInput, match="overlap"):
            list(c.iter_chunks(([("a", 0, 10), ("b", 5, 3)], 20), 4))
        with pytest.raises(errors.InvalidInput, match="chunk_size"):
            list(c.iter_chunks(([("a", 0, 10)], 20), 0))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_caller_supplied_id(service, transport):
    from encoder_service.client import ImageSource

    with sync_client(service, transport) as c:
        (info,) = c.encode([ImageSource(data=png(112, 56, 11), caller_id=f"doc-7-{transport}")], return_embeddings=True)
        assert info.id.endswith(f"doc-7-{transport}")
        got = c.fetch([(info.id, 10)], 8, 10 + info.num_tokens)
        assert torch.equal(got.rows, info.embedding)


def test_remote_error_types():
    import grpc

    from encoder_service.protocol.errors import remote_error

    err = remote_error("overloaded", "queue full", 429, 3.0)
    assert isinstance(err, errors.Overloaded) and err.retry_after_s == 3.0 and err.status == 429
    assert isinstance(remote_error("limit", "too big", 413), errors.InvalidInput)
    # No kind (a proxy's answer, gRPC's own limits): the status decides.
    assert isinstance(remote_error(None, "<html>bad gateway", 503), errors.Unavailable)
    assert isinstance(remote_error(None, "Received message larger than max", grpc.StatusCode.RESOURCE_EXHAUSTED),
                      errors.InvalidInput)
    other = remote_error(None, "teapot", 418)
    assert type(other) is errors.EncoderServiceError and "418" in str(other)
