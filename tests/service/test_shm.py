"""Shared-memory fetch (protocol/shm.py, core/shm_writer.py, client/shm.py) against the real servers
(tests/support/service.py).

Every shm fetch must equal the wire fetch byte for byte (chunks that split images, several images per
chunk, Qwen3 deepstack rows), over HTTP and gRPC, sync and async; `out` from alloc_rows is written by the
server in place; every bad target gets a 4xx / gRPC status naming the problem and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import stat

import grpc
import httpx
import pytest
import torch

from encoder_service import errors
from encoder_service.client import PromptLayout
from encoder_service.client.shm import ShmFile
from encoder_service.core import shm_writer as server_shm
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.proto import encoder_pb2_grpc as pb_grpc
from encoder_service.protocol.shm import ShmTarget
from encoder_service.ranges import chunks, plan_chunk
from encoder_service.rowpath.host_pool import PAGE, HostRowPool
from tests.support.images import image_bytes as png
from tests.support.layouts import prompt_layout, wanted

from tests.support.clients import async_client, sync_client
from tests.support.waits import async_wait_for

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]


def layout_of(infos) -> PromptLayout:
    return prompt_layout(infos, lead=3, gap=5, tail=7)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


IMAGES = [png(224, 224, 41), png(84, 140, 42), png(56, 56, 43)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fixture", ["shm_service", "shm_service_qwen3"])
def test_shm_fetch_equals_the_wire_fetch(fixture, transport, request, shm_dir):
    svc = request.getfixturevalue(fixture)
    with sync_client(svc, transport) as w, sync_client(svc, transport, shm=True, shm_dir=str(shm_dir)) as c:
        infos = w.encode(IMAGES, wait=True)
        if fixture == "shm_service_qwen3":
            assert infos[0].layout == "main+deepstack3"
        layout, width = layout_of(infos), infos[0].row_width
        # 1 and 7: chunks split images; 50: several images per chunk; prompt_len: one chunk
        for chunk_size in (1, 7, 50, layout.prompt_len):
            for start, end in chunks(layout.prompt_len, chunk_size):
                items = wanted(layout, start, end)
                if not items:
                    continue
                ref, got = w.fetch(items, start, end), c.fetch(items, start, end)
                assert got.segments == ref.segments == plan_chunk(layout.items, start, end)
                assert (got.dtype, got.layout) == (ref.dtype, ref.layout)
                assert raw(got.rows) == raw(ref.rows)
                # a caller buffer that is not shared memory: staged, then copied into place
                ref_out, out = torch.full((end - start, width), float("nan")), torch.full((end - start, width), 7.0)
                w.fetch(items, start, end, out=ref_out)
                assert c.fetch(items, start, end, out=out).rows is out
                placed = ~ref_out.isnan()
                assert raw(out[placed]) == raw(ref_out[placed]) and bool((out[~placed] == 7).all())
        # zero-copy: the whole prompt's buffer in shared memory, each chunk a row slice of it
        buf = c.alloc_rows(layout.prompt_len, width, infos[0].dtype)
        assert buf.shape == (layout.prompt_len, width) and bool((buf == 0).all())
        staged, take = [], c._shm.take_staging
        c._shm.take_staging = lambda nbytes: staged.append(nbytes) or take(nbytes)
        for chunk in c.iter_chunks(layout, 9, out=lambda s, e: buf[s:e]):
            assert chunk.rows is None or chunk.rows.data_ptr() == buf[chunk.start].data_ptr()
        assert staged == []  # the server wrote into `buf` itself: no staging file, no copy here
        full = w.encode(IMAGES, return_embeddings=True)
        expected = torch.zeros_like(buf)
        for (i, o, n), info in zip(layout.items, full):
            expected[o:o + n] = info.embedding
        assert raw(buf) == raw(expected)
        c.fetch(wanted(layout, 0, 9), 0, 9, out=buf[:9].clone())  # not in shared memory: staged
        assert len(staged) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_shm_fetch(shm_service_qwen3, transport, shm_dir):
    svc = shm_service_qwen3
    async with async_client(svc, transport) as w, async_client(svc, transport, shm=True, shm_dir=str(shm_dir)) as c:
        infos = await w.encode(IMAGES[::-1], wait=True)
        layout, width = layout_of(infos), infos[0].row_width
        spans = [(s, e) for s, e in chunks(layout.prompt_len, 11) if wanted(layout, s, e)]
        # fetches in flight together each get their own staging file
        got = await asyncio.gather(*(c.fetch(wanted(layout, s, e), s, e) for s, e in spans))
        ref = await asyncio.gather(*(w.fetch(wanted(layout, s, e), s, e) for s, e in spans))
        for g, r in zip(got, ref):
            assert g.segments == r.segments and raw(g.rows) == raw(r.rows)
        buf = c.alloc_rows(layout.prompt_len, width, torch.float32)
        async for chunk in c.iter_chunks(layout, 64, out=lambda s, e: buf[s:e]):
            assert chunk.rows is None or chunk.rows.data_ptr() == buf[chunk.start].data_ptr()
        whole = await w.fetch(wanted(layout, 0, layout.prompt_len), 0, layout.prompt_len,
                              out=torch.zeros(layout.prompt_len, width))
        assert raw(buf) == raw(whole.rows)


def test_client_files_are_private_and_unlinked_on_close(shm_service, shm_dir):
    c = sync_client(shm_service, "grpc", shm=True, shm_dir=str(shm_dir))
    (info,) = c.encode([png(112, 112, 44)], wait=True)
    kept = c.alloc_rows(info.num_tokens, info.row_width, info.dtype)
    c.fetch([(info.id, 0)], 0, info.num_tokens, out=kept)
    c.fetch([(info.id, 0)], 0, info.num_tokens)  # a staging file
    names = c._shm.files()
    assert len(names) == 2
    for name in names:
        st = os.stat(shm_dir / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    c.close()
    assert not any((shm_dir / name).exists() for name in names)
    assert kept.abs().sum() > 0  # tensors handed out stay valid: the mapping outlives the file's name
    with pytest.raises(RuntimeError, match="closed"):
        c.alloc_rows(1, info.row_width, info.dtype)


def test_staging_grows_into_a_new_file(shm_service, shm_dir):
    with sync_client(shm_service, "http", shm=True, shm_dir=str(shm_dir)) as c:
        (info,) = c.encode([png(448, 448, 45)], wait=True)
        small = c.fetch([(info.id, 0)], 0, 1)
        (first,) = c._shm.files()
        big = c.fetch([(info.id, 0)], 0, info.num_tokens)  # needs more than the first page-sized file
        (second,) = c._shm.files()
        assert first != second and not (shm_dir / first).exists()
        assert torch.equal(big.rows[:1], small.rows)


def test_a_failed_fetch_does_not_reuse_its_staging_file(shm_service, shm_dir):
    with sync_client(shm_service, "grpc", shm=True, shm_dir=str(shm_dir)) as c:
        (info,) = c.encode([png(56, 56, 50)], wait=True)
        c.fetch([(info.id, 0)], 0, info.num_tokens)
        (used,) = c._shm.files()
        with pytest.raises(errors.NotFound):
            c.fetch([("f" * 32, 0)], 0, 4)
        assert c._shm.files() == [] and not (shm_dir / used).exists()  # the server might still write into it
        assert c.fetch([(info.id, 0)], 0, info.num_tokens).rows.shape[0] == info.num_tokens


def test_rows_without_out_are_copied_out_of_staging_into_reused_memory(shm_service, shm_dir):
    with sync_client(shm_service, "http", shm=True, shm_dir=str(shm_dir)) as c:
        c._row_pool = HostRowPool(min_bytes=PAGE)  # the rows here are small: pool them all
        (info,) = c.encode([png(224, 168, 9)], wait=True, return_embeddings=True)
        for _ in range(3):
            rows = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
            assert torch.equal(rows, info.embedding)
            del rows
        assert c._row_pool.taken == {"reused": 2, "fresh": 1, "small": 0}


def test_server_keeps_a_bounded_lru_of_mappings(shm_service, shm_dir):
    writer = shm_service.core.shm
    with sync_client(shm_service, "grpc", shm=True, shm_dir=str(shm_dir)) as c:
        (info,) = c.encode([png(56, 56, 46)], wait=True)
        bufs = [c.alloc_rows(info.num_tokens, info.row_width, info.dtype) for _ in range(server_shm.MAX_OPEN + 3)]
        before = writer.stats()["evictions"]
        for buf in bufs:
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=buf)
        assert all(torch.equal(b, bufs[0]) for b in bufs)
        stats = writer.stats()
        assert stats["open"] <= server_shm.MAX_OPEN and stats["evictions"] >= before + 3
        opens = stats["opens"]
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=bufs[-1])  # still mapped: no new open
        assert writer.stats()["opens"] == opens


# ---- bad targets -------------------------------------------------------------------------------------------

def _plant(shm_dir, kind: str) -> str:
    """A file (or link, dir) with a valid name in the server's shm dir; returns the name."""
    name = "encoder-fetch-" + secrets.token_hex(16)
    path = shm_dir / name
    if kind == "symlink":
        target = ShmFile.create(str(shm_dir), 1 << 20)
        path.symlink_to(shm_dir / target.name)
        _plant.keep.append(target)
    elif kind == "small":
        path.write_bytes(b"\0" * 16)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    return name


_plant.keep = []

BAD_TARGETS = [  # (case, name or plant kind, offset, words in the message)
    ("bad name", "encoder-fetch-1234", 0, "is invalid"),
    ("upper-case hex", "encoder-fetch-" + "A" * 32, 0, "is invalid"),
    ("path traversal", "../encoder-fetch-" + "0" * 32, 0, "no directories"),
    ("absolute path", "/etc/passwd", 0, "is invalid"),
    ("missing file", "encoder-fetch-" + "0" * 32, 0, "not found"),
    ("negative offset", "encoder-fetch-" + "0" * 32, -8, "offset must be >= 0"),
    ("symlink", "@symlink", 0, "symbolic link"),
    ("too small", "@small", 0, "grow the file"),
    ("offset past the end", "@small", 8, "grow the file"),
    ("empty file", "@empty", 0, "is empty"),
    ("directory", "@dir", 0, "can't be opened"),
    ("fifo", "@fifo", 0, "not a regular file"),
]


def _target(shm_dir, spec: str) -> str:
    return _plant(shm_dir, spec[1:]) if spec.startswith("@") else spec


@pytest.mark.parametrize("case, spec, offset, words", BAD_TARGETS, ids=[c[0] for c in BAD_TARGETS])
def test_bad_targets_over_http(shm_service, shm_dir, case, spec, offset, words):
    with httpx.Client(base_url=shm_service.url, timeout=30) as h:
        (info,) = h.post("/v1/encode?wait=true", files=[("image", ("a", png(112, 112, 47)))]).json()["images"]
        body = {"items": [{"id": info["id"], "offset": 0}], "start": 0, "end": info["num_tokens"],
                "shm": {"name": _target(shm_dir, spec), "offset": offset}}
        r = h.post("/v1/fetch", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["kind"] == "invalid_input" and words in r.json()["error"]["message"]
        del body["shm"]  # still serving
        assert h.post("/v1/fetch", json=body).status_code == 200


@pytest.mark.parametrize("case, spec, offset, words", BAD_TARGETS, ids=[c[0] for c in BAD_TARGETS])
async def test_bad_targets_over_grpc(shm_service, shm_dir, case, spec, offset, words):
    async with grpc.aio.insecure_channel(shm_service.grpc_address) as channel:
        stub = pb_grpc.EncoderStub(channel)
        enc = await stub.Encode(pb.EncodeRequest(images=[pb.Image(data=png(112, 112, 47))], wait=True), timeout=30)
        info = enc.images[0]
        request = pb.FetchRequest(items=[pb.FetchItem(id=info.id, offset=0)], start=0, end=info.num_tokens,
                                  shm=pb.ShmTarget(name=_target(shm_dir, spec), offset=offset))
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            [m async for m in stub.Fetch(request, timeout=30)]
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in exc.value.details()
        request.ClearField("shm")
        assert len([m async for m in stub.Fetch(request, timeout=30)]) == 2  # still serving: header + rows


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shm_off_is_a_clear_error(service, transport, shm_dir):
    assert service.core.metadata()["shm_fetch"] is False
    with sync_client(service, transport, shm=True, shm_dir=str(shm_dir)) as c:
        (info,) = c.encode([png(56, 56, 48)], wait=True)
        with pytest.raises(errors.FailedPrecondition, match="shared-memory fetch is off.*--shm-fetch") as exc:
            c.fetch([(info.id, 0)], 0, info.num_tokens)
        assert exc.value.status in (400, grpc.StatusCode.FAILED_PRECONDITION)
        assert c.metadata()["family"]  # still serving
    with sync_client(service, transport) as c, pytest.raises(errors.InvalidInput, match="shm=True"):
        c.alloc_rows(1, 8, "float32")


def test_client_checks_what_the_server_answers(shm_service, shm_dir):
    """An answer whose shm_bytes disagrees with its header (an old server ignoring the target) is an error."""
    from encoder_service.protocol import grpc_messages as msgs
    from encoder_service.protocol.wire import WireError

    reply = msgs.ShmReply()
    reply.add(pb.FetchChunk(header=pb.FetchHeader(version=1, dtype="float32", row_width=4,
                                                  layout="main")).SerializeToString())
    with pytest.raises(WireError, match="more than its header"):
        reply.add(pb.FetchChunk(data=b"\0" * 16).SerializeToString())
    with sync_client(shm_service, "grpc", shm=True, shm_dir=str(shm_dir)) as c:
        (info,) = c.encode([png(56, 56, 49)], wait=True)
        real = c._transport.fetch_shm
        c._transport.fetch_shm = lambda *a: (real(*a)[0], 0)
        with pytest.raises(WireError, match="predate shared-memory fetch"):
            c.fetch([(info.id, 0)], 0, info.num_tokens)


async def test_writer_never_unmaps_under_a_copy(tmp_path):
    """A mapping evicted from the LRU while a request uses it stays mapped until that request is done
    (also when the request is cancelled mid-copy), then it is closed."""
    writer = server_shm.ShmWriter(str(tmp_path), max_open=2)
    files = [ShmFile.create(str(tmp_path), 1 << 20) for _ in range(3)]
    try:
        m = writer.check(ShmTarget(files[0].name, 0), 1 << 20)
        for f in files[1:]:
            writer.release(writer.check(ShmTarget(f.name, 0), 16))
        assert m.evicted and not m.mm.closed and writer.stats()["open"] == 2
        rows = torch.arange(1 << 18, dtype=torch.float32).view(-1, 64)  # 1 MiB
        task = asyncio.ensure_future(writer.write(m, 0, [(0, rows)]))
        await asyncio.sleep(0)
        task.cancel()
        # The copy (if it started) takes well under a second.
        await async_wait_for(lambda: m.mm.closed, "the evicted mapping closed", 5)
        assert m.users == 0
        again = writer.check(ShmTarget(files[0].name, 0), 1 << 20)  # mapped afresh
        assert await writer.write(again, 0, [(0, rows)]) == 1 << 20
        assert torch.equal(files[0].data.view(torch.float32).view(-1, 64), rows)
    finally:
        writer.close()
        for f in files:
            f.unlink()


async def test_a_full_shm_mount_is_an_error_not_a_crash(tmp_path, monkeypatch):
    """The server reserves the range before it writes: a full tmpfs answers ENOSPC (FailedPrecondition),
    where a store into a sparse page would have been SIGBUS. ENOSPC is injected: no test can fill /dev/shm."""
    writer = server_shm.ShmWriter(str(tmp_path))
    sparse = tmp_path / ("encoder-fetch-" + secrets.token_hex(16))  # sized but never allocated: all holes
    sparse.touch(mode=0o600)
    os.truncate(sparse, 1 << 16)
    f = ShmFile.create(str(tmp_path), 1 << 16)  # our client's files are allocated at creation
    rows = torch.ones(16, 64)
    try:
        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(server_shm.os, "posix_fallocate", no_space)
        m = writer.check(ShmTarget(sparse.name, 0), rows.numel() * 4)
        assert m.sparse
        with pytest.raises(errors.FailedPrecondition, match="no room for 4096 bytes"):
            await writer.write(m, 0, [(0, rows)])
        assert m.users == 0 and not sparse.read_bytes().strip(b"\0")  # released, nothing written
        m = writer.check(ShmTarget(f.name, 0), rows.numel() * 4)  # no holes: no fallocate needed
        assert not m.sparse and await writer.write(m, 0, [(0, rows)]) == rows.numel() * 4
        monkeypatch.undo()
        m = writer.check(ShmTarget(sparse.name, 0), rows.numel() * 4)
        assert await writer.write(m, 0, [(0, rows)]) == rows.numel() * 4
        assert os.stat(sparse).st_blocks * 512 >= rows.numel() * 4  # the written range is allocated now
    finally:
        writer.close()
        f.unlink()
