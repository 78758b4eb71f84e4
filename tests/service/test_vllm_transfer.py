"""The vLLM connector's transfer machinery (integrations/vllm/: staging, fetch, arenas, worker; vLLM-free) against
the real servers.

Staged rows and what a worker loads from them equal the client's own fetch bit for bit, through shared memory
and over both sockets, for Qwen2.5-VL and Qwen3-VL (deepstack rows); a bad item (unknown id, wrong row count,
wrong width, encoder down) fails its request and is never staged; pins end when the request finishes; ranges
go back to their arenas and the files go at close. vLLM's own objects drive the same code in
tests/engines/vllm/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from encoder_service.integrations.vllm import CONNECTOR, MODULE, ec_transfer_config
from encoder_service.integrations.vllm.fetch import RowFetcher
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.staging import Need, StagingTable
from encoder_service.integrations.vllm.worker import RowLoader
from encoder_service.models.configs import row_width
from tests.support.clients import sync_client
from tests.support.images import image_bytes as png
from tests.support.ports import free_port
from tests.support.video_cases import make_clip
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(90)

VIDEO = make_clip("mp4_h264", frames=5, width=128, height=96)  # 5 frames: 3 frame groups, the last padded


def width_of(svc) -> int:
    return row_width(json.loads((svc.checkpoint / "config.json").read_text()))


def table_for(svc, transport: str, shm: str, shm_dir, width: int | None = None, **extra) -> StagingTable:
    url = svc.url if transport == "http" else "grpc://" + svc.grpc_address
    options = ConnectorOptions.from_extra_config(
        {"url": url, "shm": shm, "shm_dir": str(shm_dir), "arena_bytes": "64KiB", **extra})
    return StagingTable(RowFetcher(options, width_of(svc) if width is None else width))


def wait_staged(table: StagingTable, request_id: str, needs: list[Need], timeout: float = 30.0) -> bool:
    """ensure() every 10 ms as vLLM's steps would; True once staged, False once the request is failed."""
    staged = False

    def settled() -> bool:
        nonlocal staged
        staged = table.ensure(request_id, needs)
        return staged or table.why(request_id) is not None

    wait_for(settled, f"{request_id} staged or failed", timeout)
    return staged


def test_package_without_vllm():
    config = ec_transfer_config("http://127.0.0.1:8000", auth_token="t", shm="off")
    assert config == {"ec_connector": CONNECTOR, "ec_role": "ec_consumer", "ec_connector_module_path": MODULE,
                      "ec_connector_extra_config": {"url": "http://127.0.0.1:8000", "auth_token": "t", "shm": "off"}}
    import encoder_service.integrations.vllm as plugin

    try:
        import vllm.config  # noqa: F401  (not `import vllm`: tests/engines/vllm passes for a namespace package)
    except ImportError:
        with pytest.raises(ImportError, match=r"needs vLLM: pip install -e '\.\[vllm\]' in a checkout"):
            plugin.EncoderServiceConnector
    with pytest.raises(AttributeError):
        plugin.NoSuchThing


def test_connector_imports_no_tower(tmp_path):
    """vLLM's EngineCore and workers import the connector: what it imports besides vLLM (its vLLM-free
    modules, the row width rule) brings in no vision tower, no server (api/) and no model registry."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": {
        "depth": 2, "hidden_size": 32, "num_heads": 2, "hidden_act": "gelu", "out_hidden_size": 48,
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
        "intermediate_size": 64, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}}))
    code = ("import json, sys; import encoder_service.integrations.vllm.staging, "
            "encoder_service.integrations.vllm.worker; from encoder_service.models.configs import row_width; "
            f"print(row_width(json.load(open({str(config)!r})))); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('encoder_service'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    width, modules = out.splitlines()
    assert width == str(48 * 3)
    loaded = modules.split()
    assert "encoder_service.integrations.vllm.fetch" in loaded
    assert not [m for m in loaded if m.startswith(("encoder_service.api", "encoder_service.core"))
                or m in ("encoder_service.models.registry", "encoder_service.models.layers")
                or m.startswith("encoder_service.models.qwen")], loaded


def test_options():
    o = ConnectorOptions.from_extra_config({"url": "grpc://h:1", "max_staged_bytes": "2GiB", "shm": True,
                                            "release_on_finish": "false", "fetch_threads": "2"})
    assert (o.transport, o.max_staged_bytes, o.shm, o.release_on_finish, o.fetch_threads) == \
        ("grpc", 2 << 30, "on", False, 2)
    assert ConnectorOptions.from_extra_config({"url": "http://h:1", "shm": "false"}).shm == "off"
    for bad, match in [({}, "'url'"), ({"url": "h:1"}, "http://host:port"), ({"url": "http://h:1", "x": 1}, "'x'"),
                       ({"url": "http://h:1", "shm": "maybe"}, "shm"),
                       ({"url": "http://h:1", "shm_dir": "rel"}, "absolute"),
                       ({"url": "http://h:1", "fetch_threads": 0}, "fetch_threads")]:
        with pytest.raises(ValueError, match=match):
            ConnectorOptions.from_extra_config(bad)


@pytest.mark.parametrize("transport,shm", [("http", "off"), ("grpc", "off"), ("http", "on"), ("grpc", "auto")])
@pytest.mark.parametrize("fixture", ["shm_service", "shm_service_qwen3"])
def test_staged_rows_equal_the_clients_fetch(request, fixture, transport, shm, shm_dir):
    svc = request.getfixturevalue(fixture)
    with sync_client(svc, "http") as client:
        seed = 300 + len(transport + shm)
        infos = client.encode([png(224, 168, seed), png(84, 56, 302), png(224, 168, seed)])
        expected = {i.id: client.fetch([(i.id, 0)], 0, i.num_tokens).rows for i in infos}
    assert infos[0].id == infos[2].id and len(expected) == 2
    table = table_for(svc, transport, shm, shm_dir)
    loader = RowLoader("cpu")
    try:
        needs = [Need(f"vllm-{i.id}", i.id, i.num_tokens) for i in infos]
        assert not table.has(needs[0].identifier)
        assert wait_staged(table, "req-1", needs)
        assert table.fetcher.mode == ("shm" if shm != "off" else transport)
        assert all(table.has(n.identifier) for n in needs)
        for n in needs:
            table.allocated("req-1", n.identifier, n.num_rows)
        loads = table.end_step()
        assert sorted(x.identifier for x in loads) == sorted({n.identifier for n in needs})
        for load in loads:
            rows = loader.load(load, width_of(svc))
            want = expected[load.identifier.removeprefix("vllm-")]
            assert rows.dtype == want.dtype and torch.equal(rows, want)
            with pytest.raises(RuntimeError, match="not loading"):
                loader.load(load, width_of(svc) + 1)
        # vLLM holds the items: they stay staged (and answer has()) until it frees them
        table.finished("req-1", [i.id for i in infos])
        assert table.end_step() == [] and all(table.has(n.identifier) for n in needs)
        table.end_step(freed=[n.identifier for n in needs])
        assert not any(table.has(n.identifier) for n in needs)
        assert sum(a.used for a in table.fetcher.arenas._arenas) == 0
        names = table.fetcher.arenas.names()
        assert names and all(os.path.exists(shm_dir / n) for n in names)
    finally:
        loader.close()
        table.close()
    assert not any(os.path.exists(shm_dir / n) for n in names)


@pytest.mark.parametrize("transport,shm", [("http", "on"), ("grpc", "off")])
@pytest.mark.parametrize("fixture", ["shm_service", "shm_service_qwen3"])
def test_staged_video_equals_its_groups(request, fixture, transport, shm, shm_dir):
    """A video is one vLLM item: all its frame groups' rows, group after group, equal to the client's fetch of
    the groups; a plan that cuts the rows into other groups fails the request with the reason."""
    svc = request.getfixturevalue(fixture)
    with sync_client(svc, "http") as client:
        (video,) = client.encode_videos([VIDEO], sample_frames=False)
        want = client.fetch(video.fetch_items(0), 0, video.num_tokens).rows
    t, per_group = video.num_groups, video.tokens_per_group
    assert t == 3 and want.shape == (video.num_tokens, width_of(svc))
    table = table_for(svc, transport, shm, shm_dir)
    loader = RowLoader("cpu")
    try:
        need = Need("vllm-video", video.id, video.num_tokens, t)
        assert wait_staged(table, "r", [need])
        table.allocated("r", need.identifier, need.num_rows)
        (load,) = table.end_step()
        assert torch.equal(loader.load(load, width_of(svc)), want)
    finally:
        loader.close()
        table.close()
    cases = {  # request -> (its plan: rows, groups; the reason it fails)
        "more groups": ((t + 1) * per_group, t + 1, "is not at the encoder service"),
        "larger groups": (2 * video.num_tokens, t, f"has {per_group} rows at the encoder service, vLLM planned "
                                                   f"{2 * per_group} a group"),
        "smaller groups": (t * (per_group // 2), t, "overlap"),
        "image plan": (video.num_tokens, None, "is a video: fetch names its frame groups"),
    }
    table, loader = table_for(svc, transport, shm, shm_dir), RowLoader("cpu")
    try:
        for request_id, (rows, groups, why) in cases.items():
            assert not wait_staged(table, request_id, [Need(request_id, video.id, rows, groups)]), request_id
            assert why in table.why(request_id), (request_id, table.why(request_id))
        # fewer groups than the video has: its first groups (each group is encoded on its own)
        assert wait_staged(table, "prefix", [Need("prefix", video.id, (t - 1) * per_group, t - 1)])
        table.allocated("prefix", "prefix", (t - 1) * per_group)
        (load,) = table.end_step()
        assert torch.equal(loader.load(load, width_of(svc)), want[:(t - 1) * per_group])
    finally:
        loader.close()
        table.close()


def test_fetch_ahead_is_bounded(shm_service, shm_dir):
    with sync_client(shm_service, "http") as client:
        infos = client.encode([png(224, 168, 310 + k) for k in range(3)])
    row_bytes = width_of(shm_service) * 4
    # room for about one image ahead: the second waits until the first is taken by vLLM
    table = table_for(shm_service, "http", "on", shm_dir, max_staged_bytes=(infos[0].num_tokens + 2) * row_bytes)
    try:
        needs = [Need(i.id, i.id, i.num_tokens) for i in infos]
        assert wait_staged(table, "r0", needs[:1])
        assert not table.ensure("r1", needs[1:2]) and table.counters["fetches"] == 1
        table.allocated("r0", needs[0].identifier, needs[0].num_rows)
        assert len(table.end_step()) == 1
        assert wait_staged(table, "r1", needs[1:2]) and table.counters["fetches"] == 2
    finally:
        table.close()


def test_bad_items_fail_the_request(shm_service, shm_service_qwen3, shm_dir):
    with sync_client(shm_service, "http") as client:
        (info,) = client.encode([png(224, 168, 320)])
    n = info.num_tokens
    table = table_for(shm_service, "grpc", "off", shm_dir)
    try:
        cases = {"unknown": Need("x", "f" * 32, n), "fewer": Need(info.id, info.id, n + 3),
                 "more": Need("alias", info.id, n - 1)}
        for request_id, need in cases.items():
            assert not wait_staged(table, request_id, [need])
            assert not table.has(need.identifier)
        assert "not at the encoder service" in table.why("unknown")
        assert f"has {n} rows" in table.why("fewer") and f"planned {n + 3}" in table.why("fewer")
        assert f"has more than {n - 1} rows" in table.why("more")
        assert table.take_failed() == set(cases) and table.take_failed() == set()
        assert not table.ensure("unknown", [cases["unknown"]])  # failed and reported: stays off until finished
        assert table.end_step() == [] and table.staged_bytes() == 0
        for request_id in cases:
            table.finished(request_id)
        assert wait_staged(table, "good", [Need(info.id, info.id, n)])  # the same id, asked right, works
    finally:
        table.close()
    wrong_width = table_for(shm_service_qwen3, "http", "off", shm_dir, width=width_of(shm_service))
    down = StagingTable(RowFetcher(ConnectorOptions(f"http://127.0.0.1:{free_port()}", shm_dir=str(shm_dir),
                                                    fetch_timeout_s=5)))
    try:
        assert not wait_staged(wrong_width, "w", [Need(info.id, info.id, n)])
        assert "rows 192 wide" in wrong_width.why("w") and "takes rows 48 wide" in wrong_width.why("w")
        assert not wait_staged(down, "d", [Need(info.id, info.id, n)])
        assert "unreachable" in down.why("d")
    finally:
        wrong_width.close()
        down.close()


def test_finish_releases_the_pins(shm_service, shm_dir):
    with sync_client(shm_service, "http") as client:
        a, b = client.encode([png(224, 168, 330), png(84, 56, 331)])
        assert shm_service.pinned(a.id) and shm_service.pinned(b.id)
        table = table_for(shm_service, "http", "on", shm_dir)
        try:
            assert wait_staged(table, "r", [Need(a.id, a.id, a.num_tokens), Need(b.id, b.id, b.num_tokens)])
            table.finished("r", [a.id, b.id, a.id])
            wait_for(lambda: not shm_service.pinned(a.id) and not shm_service.pinned(b.id), "both pins released", 10)
        finally:
            table.close()

