"""The fetch by IPC (protocol/ipc.py, core/ipc_fetch.py, client/ipc.py) against the real HTTP server, with the
device row arena's memory and the consumer's reader replaced by the host-memory stand-in
(encoder_service/testing/host_ipc.py): the allocator, holds, leases, HTTP protocol, acknowledgements, pins and
every fallback are the ones a GPU runs; tests/gpu/test_ipc_cuda.py runs the CUDA memory and reader.

Rows by IPC must equal the socket fetch's byte for byte (chunks that split images, several images per chunk,
Qwen3 rows), also in another process; every reason not to use IPC ends in the next path with no error to the
caller; bad requests are 400s naming what is wrong.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import httpx
import pytest
import torch

from encoder_service import errors
from encoder_service.api.service import bind_socket, build_core
from encoder_service.client import AsyncEncoderClient, EncoderClient, PromptLayout
from encoder_service.client import ipc as client_ipc
from encoder_service.protocol.ipc import this_host
from encoder_service.ranges import chunks, plan_chunk
from encoder_service.testing.host_ipc import HostStandInMemory, HostStandInReader
from tests.support.images import image_bytes as png
from tests.support.layouts import prompt_layout, wanted
from tests.support.service import RunningService, make_settings
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)

IMAGES = [png(224, 224, 61), png(84, 140, 62), png(56, 56, 63)]


def ipc_service(checkpoint, directory, *flags, http_sock=None) -> RunningService:
    """The service with a device row arena on the host stand-in (files in `directory`)."""
    settings = make_settings(checkpoint, "--ipc-arena-bytes", "4MiB", *flags)
    core = build_core(settings, ipc_memory=HostStandInMemory.factory(str(directory)))
    return RunningService(settings, checkpoint, core=core, http_sock=http_sock)


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ipc")


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def svc(request, tiny_checkpoint, standin_dir):
    service = ipc_service(tiny_checkpoint(request.param), standin_dir)
    request.addfinalizer(service.close)
    return service


def client(svc, directory, **kw) -> EncoderClient:
    return EncoderClient.http(svc.url, timeout=30, ipc=HostStandInReader(str(directory), **kw))


def layout_of(infos) -> PromptLayout:
    return prompt_layout(infos, lead=3, gap=5, tail=7)


def nan_out(n: int, width: int) -> torch.Tensor:
    return torch.full((n, width), float("nan"))


def raw_fetch(svc, items, start, end, ipc: dict, **extra) -> httpx.Response:
    body = {"items": [{"id": i, "offset": o} for i, o in items], "start": start, "end": end, "ipc": ipc} | extra
    return httpx.post(svc.url + "/v1/fetch", json=body, timeout=30)


def test_metadata_says_where_ipc_is(svc):
    meta = httpx.get(svc.url + "/v1/metadata", timeout=10).json()["ipc"]
    assert meta["host"] == this_host() and meta["kind"] == "host-standin" and meta["arena_bytes"] == 4 << 20


def test_ipc_fetch_equals_the_socket_fetch(svc, standin_dir):
    with client(svc, standin_dir) as c, EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        infos = w.encode(IMAGES, wait=True)
        layout, width = layout_of(infos), infos[0].row_width
        fetched = 0
        for chunk_size in (1, 7, 50, layout.prompt_len):  # chunks that split images; several per chunk; one
            for start, end in chunks(layout.prompt_len, chunk_size):
                items = wanted(layout, start, end)
                if not items:
                    continue
                ref, out = nan_out(end - start, width), nan_out(end - start, width)
                w.fetch(items, start, end, out=ref)
                got = c.fetch(items, start, end, out=out)
                fetched += 1
                assert got.rows is out and got.segments == plan_chunk(layout.items, start, end)
                assert torch.equal(out.view(torch.int32), ref.view(torch.int32))  # NaN rows (text) alike too
        assert c.fetch_paths == {"ipc": fetched} and w.fetch_paths["socket"] == fetched
    assert svc.sample("encoder_ipc_fetches_total", {"outcome": "held"}) >= fetched


def test_an_out_of_another_dtype_or_strided_gets_the_rows_cast(svc, standin_dir):
    with client(svc, standin_dir) as c:
        (info,) = c.encode(IMAGES[:1], wait=True)
        ref = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
        wide = torch.zeros(info.num_tokens + 2, info.row_width, dtype=torch.float64)
        strided = torch.zeros(info.row_width, info.num_tokens).t()  # rows not contiguous
        c.fetch([(info.id, 2)], 0, info.num_tokens + 2, out=wide)
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=strided)
        assert torch.equal(wide[2:], ref.double()) and torch.equal(strided, ref)
        assert c.fetch_paths == {"ipc": 2, "socket": 1}


def test_async_client_fetches_by_ipc(svc, standin_dir):
    async def go():
        async with AsyncEncoderClient.http(svc.url, timeout=30, ipc=HostStandInReader(str(standin_dir))) as c:
            (info,) = await c.encode(IMAGES[:1], wait=True)
            out = nan_out(info.num_tokens, info.row_width)
            await c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
            ref = (await c.fetch([(info.id, 0)], 0, info.num_tokens)).rows
            return out, ref, dict(c.fetch_paths)

    out, ref, paths = asyncio.run(go())
    assert torch.equal(out, ref) and paths == {"ipc": 1, "socket": 1}


def test_a_consumer_in_another_process(svc, standin_dir, tmp_path):
    with EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        infos = w.encode(IMAGES, wait=True)
        layout = layout_of(infos)
        fetches = [dict(items=wanted(layout, s, e), start=s, end=e) for s, e in chunks(layout.prompt_len, 50)]
        refs = [w.fetch(f["items"], f["start"], f["end"], out=nan_out(f["end"] - f["start"], infos[0].row_width))
                for f in fetches]
    job = tmp_path / "job.json"
    job.write_text(json.dumps(dict(url=svc.url, fetches=fetches, device="cpu", standin_dir=str(standin_dir),
                                   out_dir=str(tmp_path))))
    done = subprocess.run([sys.executable, "-m", "tests.support.ipc_consumer", str(job)], capture_output=True,
                          text=True, timeout=90, check=True)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer == {"paths": {"ipc": len(fetches)}, "opened": 1, "ipc_off": None}
    for k, ref in enumerate(refs):
        assert (tmp_path / f"{k}.bin").read_bytes() == ref.rows.view(-1).view(torch.uint8).numpy().tobytes()


def test_a_hold_ends_at_its_acknowledgement_which_ends_the_pin(svc):
    with EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        (info,) = w.encode([png(112, 112, 64)], wait=True)
    assert svc.pinned(info.id)
    answer = raw_fetch(svc, [(info.id, 0)], 0, info.num_tokens, {"host": this_host()}).json()
    token = answer["ipc"]["token"]
    assert len(answer["ipc"]["offsets"]) == 1 and answer["num_rows"] == info.num_tokens
    assert svc.pinned(info.id)  # delivered only once the consumer says its copy is done
    assert svc.sample("encoder_ipc_arena_holds") == 1
    ack = httpx.post(svc.url + "/v1/fetch/ack", json={"tokens": [token, token, "f" * 32]}, timeout=10)
    assert ack.json() == {"released": 1}  # repeated and unknown tokens are ignored
    assert not svc.pinned(info.id) and svc.sample("encoder_ipc_arena_holds") == 0


def test_acks_ride_on_the_next_fetch(svc):
    with EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        infos = w.encode([png(112, 112, 65), png(112, 112, 66)], wait=True)
    first = raw_fetch(svc, [(infos[0].id, 0)], 0, infos[0].num_tokens, {"host": this_host()}).json()
    second = raw_fetch(svc, [(infos[1].id, 0)], 0, infos[1].num_tokens,
                       {"host": this_host(), "ack": [first["ipc"]["token"]]}).json()
    assert not svc.pinned(infos[0].id) and svc.pinned(infos[1].id)
    httpx.post(svc.url + "/v1/fetch/ack", json={"tokens": [second["ipc"]["token"]]}, timeout=10)


def test_a_probe_holds_and_delivers_nothing(svc):
    with EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        (info,) = w.encode([png(112, 112, 67)], wait=True)
    answer = raw_fetch(svc, [(info.id, 0)], 0, info.num_tokens, {"host": this_host(), "hold": False}).json()
    assert answer["ipc"]["token"] is None and len(answer["ipc"]["offsets"]) == 1
    assert svc.pinned(info.id) and svc.sample("encoder_ipc_arena_holds") == 0


def test_a_consumer_on_another_host_is_told_so(svc):
    with EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        (info,) = w.encode(IMAGES[:1], wait=True)
    answer = raw_fetch(svc, [(info.id, 0)], 0, info.num_tokens, {"host": "another-host"})
    assert answer.status_code == 200 and "another host" in answer.json()["ipc"]["unavailable"]


@pytest.mark.parametrize("body, says", [
    ({"ipc": {"host": "h", "ack": ["nothex"]}}, "hold token"),
    ({"ipc": {"host": "h", "ack": ["f" * 32] * 1025}}, "over the limit"),
    ({"ipc": {"host": "h", "hold": "yes"}}, "hold"),
    ({"ipc": {"host": "h"}, "shm": {"name": "encoder-fetch-" + "0" * 32, "offset": 0}}, "shm or ipc"),
])
def test_bad_ipc_requests_are_400s_naming_the_problem(svc, body, says):
    with EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        (info,) = w.encode(IMAGES[:1], wait=True)
    r = httpx.post(svc.url + "/v1/fetch", json={"items": [{"id": info.id, "offset": 0}], "start": 0,
                                                "end": info.num_tokens} | body, timeout=10)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("tokens", [["xyz"], ["f" * 32] * 1025])
def test_bad_acks_are_400s(svc, tokens):
    r = httpx.post(svc.url + "/v1/fetch/ack", json={"tokens": tokens}, timeout=10)
    assert r.status_code == 400 and "token" in r.json()["error"]["message"]


# ---- fallbacks: the next path, one log line, no error ---------------------------------------------------
def fetch_twice(c: EncoderClient, info) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for _ in range(2):
        outs.append(nan_out(info.num_tokens, info.row_width))
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=outs[-1])
    return outs[0], outs[1]


def reference(svc, info) -> torch.Tensor:
    with EncoderClient.http(svc.url, timeout=30, ipc="off") as w:
        return w.fetch([(info.id, 0)], 0, info.num_tokens).rows


def test_a_refused_open_turns_ipc_off_for_the_client(svc, standin_dir, caplog):
    with client(svc, standin_dir, refuse=True) as c, caplog.at_level(logging.INFO, "encoder_service.client"):
        (info,) = c.encode([png(112, 112, 68)], wait=True)
        a, b = fetch_twice(c, info)
        assert c.fetch_paths == {"socket": 2}  # the second fetch does not even ask
    assert torch.equal(a, reference(svc, info)) and torch.equal(b, a)
    assert len([r for r in caplog.records if "fetch by IPC is off" in r.message]) == 1
    wait_for(lambda: svc.sample("encoder_ipc_arena_holds") == 0, "the refused fetch's hold acknowledged")


def test_rows_not_in_the_arena_go_the_next_way(tiny_checkpoint, standin_dir, caplog):
    small = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, "--ipc-arena-bytes", "1KiB")
    try:
        with client(small, standin_dir) as c, caplog.at_level(logging.INFO, "encoder_service.client"):
            (info,) = c.encode([png(112, 112, 69)], wait=True)  # 3 KiB of rows: larger than the arena
            a, b = fetch_twice(c, info)
            assert c.fetch_paths == {"socket": 2}
        assert torch.equal(a, reference(small, info)) and torch.equal(b, a)
        assert len([r for r in caplog.records if "not in the device arena" in r.message]) == 1  # once per reason
        assert small.sample("encoder_ipc_fetches_total", {"outcome": "not_in_arena"}) == 2
        assert small.sample("encoder_ipc_arena_not_stored_total") >= 1
    finally:
        small.close()


def test_a_copy_past_the_lease_is_not_used(tiny_checkpoint, standin_dir, caplog):
    brief = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, "--ipc-lease-s", "0.000001")
    try:
        with client(brief, standin_dir) as c, caplog.at_level(logging.INFO, "encoder_service.client"):
            (info,) = c.encode([png(112, 112, 70)], wait=True)
            a, _ = fetch_twice(c, info)
            assert c.fetch_paths == {"socket": 2}  # each copy ended past its hold: fetched again
        assert torch.equal(a, reference(brief, info))
        assert any("past the" in r.message for r in caplog.records)
    finally:
        brief.close()


def test_the_acknowledgements_of_a_fetch_that_failed_are_sent_later(tiny_checkpoint, standin_dir, monkeypatch):
    """Before: the tokens a fetch by IPC took along were lost when it failed (a 503 before the server read
    them): their holds, and the pins they end, lasted to the lease."""
    monkeypatch.setattr(client_ipc, "ACK_DELAY_S", 60.0)  # a token waits for a fetch to carry it
    svc = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, "--ipc-lease-s", "120")
    holds = lambda: svc.core.ipc.arena.stats()["holds"]  # noqa: E731
    try:
        with client(svc, standin_dir) as c:
            (info,) = c.encode([png(112, 112, 71)], wait=True)
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
            assert c.fetch_paths == {"ipc": 1} and holds() == 1  # its token waits
            c.timeout, svc.core._ready = 0.5, False  # not ready: 503 before the request is read
            try:
                with pytest.raises(errors.Unavailable):
                    c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
            finally:
                svc.core._ready = True
            assert holds() == 1
        wait_for(lambda: holds() == 0, "the token acknowledged at the client's close", 10)
    finally:
        svc.close()


def test_a_server_without_an_arena_is_not_asked(service):
    with EncoderClient.http(service.url, timeout=30, ipc=HostStandInReader()) as c:
        assert c.metadata()["ipc"] is None
        (info,) = c.encode(IMAGES[:1], wait=True)
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
        assert c.fetch_paths == {"socket": 1}
    answer = raw_fetch(service, [(info.id, 0)], 0, info.num_tokens, {"host": this_host()}).json()
    assert "off" in answer["ipc"]["unavailable"]


def test_a_client_on_another_host_does_not_ask(svc, standin_dir, monkeypatch):
    monkeypatch.setattr("encoder_service.client.ipc.this_host", lambda: "another-host")
    with client(svc, standin_dir) as c:
        (info,) = c.encode(IMAGES[:1], wait=True)
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
        assert c.fetch_paths == {"socket": 1}


def test_grpc_and_cpu_outs_never_ask(svc):
    with EncoderClient.grpc(svc.grpc_address, timeout=30) as g, EncoderClient.http(svc.url, timeout=30) as h:
        (info,) = h.encode(IMAGES[:1], wait=True)
        for c in (g, h):  # gRPC: no IPC; the default (CUDA) reader: not for a CPU out
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=nan_out(info.num_tokens, info.row_width))
            assert c.fetch_paths == {"socket": 1}


def test_a_restarted_server_is_a_new_generation(tiny_checkpoint, standin_dir):
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    first = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, http_sock=sock)
    reader = HostStandInReader(str(standin_dir))
    with EncoderClient.http(first.url, timeout=30, ipc=reader) as c:
        try:
            (info,) = c.encode(IMAGES[:1], wait=True)
            a = nan_out(info.num_tokens, info.row_width)
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=a)
        finally:
            first.close()
        second = ipc_service(tiny_checkpoint("qwen2_5_vl"), standin_dir, http_sock=bind_socket("127.0.0.1", port))
        try:
            c.encode(IMAGES[:1], wait=True)
            b = nan_out(info.num_tokens, info.row_width)
            c.fetch([(info.id, 0)], 0, info.num_tokens, out=b)
        finally:
            second.close()
        assert c.fetch_paths == {"ipc": 2} and reader.opened == 2
    assert torch.equal(a, b)
