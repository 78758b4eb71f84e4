"""The vLLM connector's rows GPU to GPU (integrations/vllm/fetch.py's hold, ipc_loads.py, worker.py; vLLM-free)
against the real server, with the host-memory stand-in (encoder_service/testing/host_ipc.py) for the encoder's
device memory and the workers' CUDA reader.

An item found in the encoder's arena is left there and held (nothing staged in host memory); each worker's
load copies it under that hold with no request of its own, equal to the client's fetch bit for bit (an image,
and a video's frame groups), and the hold is acknowledged once reported; a load again, or past its hold's
deadline, is fetched by the worker; a hold no load took is acknowledged when the item goes; an item not in the
arena is staged the shm / socket way; a worker whose open is refused still loads the rows and tells the
scheduler side, which then stages.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
import subprocess
import sys

import pytest
import torch

from encoder_service.api.service import build_core
from encoder_service.client import EncoderClient
from encoder_service.integrations.vllm import fetch as vllm_fetch
from encoder_service.integrations.vllm.fetch import RowFetcher
from encoder_service.integrations.vllm.ipc_loads import IpcLoader
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.staging import Need, StagingTable
from encoder_service.integrations.vllm.worker import IpcRows, RowLoader, ShmRows
from encoder_service.models.configs import row_width
from encoder_service.testing.host_ipc import KIND, HostStandInMemory, HostStandInReader
from tests.support.images import image_bytes as png
from tests.support.service import RunningService, make_settings
from tests.support.video_cases import make_clip
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-ipc")


def service(request, checkpoint, directory, arena: str = "4MiB", *flags: str) -> RunningService:
    settings = make_settings(checkpoint, "--ipc-arena-bytes", arena, "--shm-fetch", "--shm-dir", str(directory),
                             *flags)
    svc = RunningService(settings, checkpoint,
                         core=build_core(settings, ipc_memory=HostStandInMemory.factory(str(directory))))
    request.addfinalizer(svc.close)
    return svc


@pytest.fixture(scope="module")
def svc(request, tiny_checkpoint, standin_dir):
    return service(request, tiny_checkpoint("qwen3_vl"), standin_dir)


@contextmanager
def sides(svc, directory, *, refuse: bool = False, **extra):
    """The scheduler side's table and one worker's loader, both as the connector builds them (the workers'
    IPC kind: the stand-in's), closed on leaving."""
    options = ConnectorOptions.from_extra_config({"url": svc.url, "shm_dir": str(directory), **extra})
    width = row_width(json.loads((svc.checkpoint / "config.json").read_text()))
    table = StagingTable(RowFetcher(options, width, ipc_kind=KIND))
    loader = RowLoader("cpu", None, ipc=IpcLoader(options, "cpu", reader=HostStandInReader(str(directory), refuse)))
    try:
        yield table, loader, width
    finally:
        table.close()
        loader.close()


def holds(svc) -> int:
    """Live hold tokens in the service's arena."""
    return svc.core.ipc.arena.stats()["holds"]


def staged_load(table: StagingTable, need: Need, request_id: str):
    wait_for(lambda: table.ensure(request_id, [need]) or table.why(request_id), f"{need.item_id} staged", 30)
    assert table.why(request_id) is None
    table.allocated(request_id, need.identifier, need.num_rows)
    (load,) = table.end_step()
    return load


def test_an_item_in_the_arena_stays_there_and_the_worker_copies_it(svc, standin_dir):
    with sides(svc, standin_dir) as (table, loader, width):
        with EncoderClient.http(svc.url, timeout=30) as c:
            (info,) = c.encode([png(112, 112, 81)], wait=True)
            reference = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
        load = staged_load(table, Need(info.id, info.id, info.num_tokens), "r1")
        assert isinstance(load.rows, IpcRows) and load.rows.hold is not None and table.fetcher.mode == "ipc"
        assert table.staged_bytes() == 0  # nothing of it in our host memory
        assert holds(svc) == 1
        rows = loader.load(load, width)
        assert torch.equal(rows, reference)
        assert not loader.ipc.client().fetch_paths  # the worker copied under the scheduler side's hold
        table.fetcher.copied(loader.ipc.take_copied())  # what the connector passes on, worker -> scheduler
        wait_for(lambda: holds(svc) == 0, "the hold acknowledged", 10)


def test_a_load_again_or_past_its_deadline_is_fetched_by_the_worker(svc, standin_dir):
    """vLLM loads an item again after evicting it: the scheduler side's hold went with the first load, so the
    worker fetches (by IPC, with a hold of its own); a hold whose deadline passed is not read either."""
    with sides(svc, standin_dir) as (table, loader, width):
        with EncoderClient.http(svc.url, timeout=30) as c:
            (info,) = c.encode([png(112, 112, 87)], wait=True)
            reference = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
        need = Need(info.id, info.id, info.num_tokens)
        first = staged_load(table, need, "r6")
        assert torch.equal(loader.load(first, width), reference)
        table.allocated("r7", need.identifier, need.num_rows)  # the same staged item, loaded again
        (again,) = table.end_step()
        assert isinstance(again.rows, IpcRows) and again.rows.hold is None
        assert torch.equal(loader.load(again, width), reference)
        assert loader.ipc.client().fetch_paths == {"ipc": 1}
        late = dataclasses.replace(first.rows, hold=dataclasses.replace(first.rows.hold, deadline=0.0))
        assert torch.equal(loader.load(dataclasses.replace(first, rows=late), width), reference)
        assert loader.ipc.client().fetch_paths == {"ipc": 2}
        table.fetcher.copied(loader.ipc.take_copied())
        wait_for(lambda: holds(svc) == 0, "every hold acknowledged", 10)


def test_a_hold_no_load_took_is_acknowledged_when_the_item_goes(svc, standin_dir):
    with sides(svc, standin_dir) as (table, _, _):
        with EncoderClient.http(svc.url, timeout=30) as c:
            (info,) = c.encode([png(112, 112, 88)], wait=True)
        need = Need(info.id, info.id, info.num_tokens)
        wait_for(lambda: table.ensure("r8", [need]), "staged", 30)
        assert holds(svc) == 1
        table.finished("r8")  # the request went before vLLM allocated the item
        table.end_step()
        wait_for(lambda: holds(svc) == 0, "the unused hold acknowledged", 10)


def test_a_hold_no_longer_remembered_is_left_to_its_lease(request, tiny_checkpoint, standin_dir, monkeypatch):
    """A hold pushed out of the fetcher's books (MAX_HOLDS) is not acknowledged. Before: it went to the Service,
    which need not be the replica that held it (an owner behind the Service); here the Service is that replica,
    so the acknowledgement shows."""
    monkeypatch.setattr(vllm_fetch, "MAX_HOLDS", 1)
    roomy = service(request, tiny_checkpoint("qwen3_vl"), standin_dir, "4MiB", "--ipc-lease-s", "120")
    with EncoderClient.http(roomy.url, timeout=30, ipc="off") as c:
        infos = c.encode([png(64, 64, 4201), png(64, 64, 4202)], wait=True)
    options = ConnectorOptions.from_extra_config({"url": roomy.url, "shm_dir": str(standin_dir)})
    width = row_width(json.loads((roomy.checkpoint / "config.json").read_text()))
    fetcher = RowFetcher(options, width, ipc_kind=KIND)
    try:
        first, second = (fetcher.fetch(i.id, i.num_tokens).ref.hold.placement.token for i in infos)
        assert holds(roomy) == 2
        fetcher.copied([first, second])  # `first` was pushed out by `second`
        wait_for(lambda: holds(roomy) <= 1, "the remembered hold acknowledged", 30)
        assert holds(roomy) == 1
    finally:
        fetcher.close()


def test_a_video_is_all_its_frame_groups(svc, standin_dir):
    with sides(svc, standin_dir) as (table, loader, width):
        with EncoderClient.http(svc.url, timeout=30) as c:
            (video,) = c.encode_videos([make_clip("mp4_h264", frames=5, width=128, height=96)], wait=True)
            items = video.fetch_items(0)
            reference = c.fetch([(i, o) for i, o, _ in items], 0, video.num_tokens).rows
        groups = len(items)
        load = staged_load(table, Need("v", video.id, video.num_tokens, groups), "r2")
        assert isinstance(load.rows, IpcRows) and load.rows.groups == groups
        assert torch.equal(loader.load(load, width), reference)


def test_an_item_not_in_the_arena_is_staged(request, tiny_checkpoint, standin_dir):
    small = service(request, tiny_checkpoint("qwen3_vl"), standin_dir, arena="1KiB")  # no entry fits
    with sides(small, standin_dir) as (table, loader, width):
        with EncoderClient.http(small.url, timeout=30) as c:
            (info,) = c.encode([png(112, 112, 82)], wait=True)
            reference = c.fetch([(info.id, 0)], 0, info.num_tokens).rows
        load = staged_load(table, Need(info.id, info.id, info.num_tokens), "r3")
        assert isinstance(load.rows, ShmRows) and table.fetcher.mode == "ipc"  # per item: IPC stays on
        assert torch.equal(loader.load(load, width), reference)


def test_a_refused_worker_still_loads_and_the_scheduler_side_stages_after(svc, standin_dir):
    with sides(svc, standin_dir, refuse=True) as (table, loader, width):
        with EncoderClient.http(svc.url, timeout=30) as c:
            a, b = c.encode([png(112, 112, 83), png(112, 112, 84)], wait=True)
            reference = c.fetch([(a.id, 0)], 0, a.num_tokens).rows
        load = staged_load(table, Need(a.id, a.id, a.num_tokens), "r4")
        assert isinstance(load.rows, IpcRows)
        assert torch.equal(loader.load(load, width), reference)  # the worker's client went the socket way
        assert loader.ipc.refused is not None
        table.fetcher.ipc_refused(loader.ipc.refused)  # what the connector passes on (worker -> scheduler)
        assert table.fetcher.mode == "shm"
        load_b = staged_load(table, Need(b.id, b.id, b.num_tokens), "r5")
        assert isinstance(load_b.rows, ShmRows)


def test_no_ipc_without_a_worker_kind_or_when_off(svc, standin_dir):
    for kind, extra in ((None, {}), (KIND, {"ipc": "off"})):
        options = ConnectorOptions.from_extra_config({"url": svc.url, "shm_dir": str(standin_dir), **extra})
        fetcher = RowFetcher(options, None, ipc_kind=kind)
        try:
            fetcher.metadata()
            assert fetcher.mode == "shm"
        finally:
            fetcher.close()


def test_a_worker_in_another_process(svc, standin_dir, tmp_path):
    """The connector's two sides in a process of their own (tests/support/ipc_consumer.py, what the GPU tier
    runs on CUDA): every item left on the encoder's side and loaded by IPC, equal to the client's fetch."""
    with EncoderClient.http(svc.url, timeout=30) as c:
        infos = c.encode([png(112, 112, 85), png(84, 140, 86)], wait=True)
        refs = [c.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos]
    job = tmp_path / "job.json"
    job.write_text(json.dumps(dict(url=svc.url, via="connector", device="cpu", standin_dir=str(standin_dir),
                                   out_dir=str(tmp_path), fetches=[dict(items=[[i.id, 0]], start=0, end=i.num_tokens)
                                                                   for i in infos])))
    done = subprocess.run([sys.executable, "-m", "tests.support.ipc_consumer", str(job)], capture_output=True,
                          text=True, timeout=90, check=True)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["staged"] == ["ipc", "ipc"] and answer["copied"] == 2 and not answer["paths"]
    assert answer["ipc_off"] is None
    for k, ref in enumerate(refs):
        assert (tmp_path / f"{k}.bin").read_bytes() == ref.view(-1).view(torch.uint8).numpy().tobytes()
