"""The fetch by IPC on CUDA (runtime/arena_memory.py, rowpath/cuda_ipc.py, client/ipc.py: CudaIpcReader): the
device row arena is one cudaMalloc allocation with an IPC handle, holding each encoded image's rows bit for bit;
a consumer in another process (spawned with subprocess: tests/support/ipc_consumer.py) copies them GPU to GPU
into its `out` on the same GPU and, when two are visible, on another, as our client and as vLLM's connector
(scheduler side's probe, a worker's load), bit-identical to the socket path's rows; a consumer in the
server's own process (CUDA refuses to open a handle there) gets the same rows the next way, no error.

Where this host refuses CUDA IPC to another process (a container without the right capabilities, MIG), the
rows must still be right (the fallback) and the test is skipped naming CUDA's refusal.

    python -m pytest -q tests/gpu/test_ipc_cuda.py -rs     # about a minute on one H200 (each consumer a process)
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch

from encoder_service.client import EncoderClient, PromptLayout
from encoder_service.protocol.ipc import this_host
from encoder_service.ranges import chunks
from tests.support.images import image_bytes as png
from tests.support.service import RunningService, make_settings

pytestmark = pytest.mark.timeout(300)

IMAGES = [png(224, 224, 71), png(84, 140, 72), png(56, 56, 73)]
DEVICES = ["cuda:0", pytest.param("cuda:1", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="one GPU visible: the copy across GPUs needs two"))]


@pytest.fixture(scope="module")
def svc(request, tiny_checkpoint):
    """Tiny Qwen3-VL (deepstack rows) on cuda:0, float32 (as tests/gpu/test_video_core_cuda.py runs the tiny
    towers), CUDA graphs as the service runs them, a 64 MiB arena."""
    settings = make_settings(tiny_checkpoint("qwen3_vl"), "--device", "cuda:0", "--dtype", "float32",
                             "--ipc-arena-bytes", "64MiB")
    service = RunningService(settings, tiny_checkpoint("qwen3_vl"))
    request.addfinalizer(service.close)
    return service


@pytest.fixture(scope="module")
def encoded(svc):
    """(infos, layout: text(3) img0 text(5) img1 img2 text(2))."""
    with EncoderClient.http(svc.url, timeout=60, ipc="off") as c:
        infos = c.encode(IMAGES, wait=True)
    items, offset = [], 3
    for k, info in enumerate(infos):
        items.append((info.id, offset, info.num_tokens))
        offset += info.num_tokens + (0 if k == 1 else 5)
    return infos, PromptLayout(items, offset + 2)


def socket_rows(svc, items, start, end, width) -> torch.Tensor:
    with EncoderClient.http(svc.url, timeout=60, ipc="off") as c:
        out = torch.full((end - start, width), float("nan"), dtype=getattr(torch, svc.core.dtype))
        c.fetch(items, start, end, out=out)
        return out


def raw(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def consume(job: dict, tmp_path) -> dict:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job | {"out_dir": str(tmp_path)}))
    done = subprocess.run([sys.executable, "-m", "tests.support.ipc_consumer", str(path)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_arena_is_cuda_memory_with_a_handle(svc):
    arena = svc.core.ipc.arena
    assert arena is not None, "no arena: see the startup log's 'device row arena' line"
    assert arena.memory.kind == "cuda" and len(arena.memory.handle) == 64 and arena.memory.bytes.is_cuda
    meta = httpx.get(svc.url + "/v1/metadata", timeout=10).json()["ipc"]
    assert meta["kind"] == "cuda" and meta["host"] == this_host() and meta["device"] == "cuda:0"


def test_the_arena_holds_each_image_rows_bit_for_bit(svc, encoded):
    infos, _ = encoded
    arena = svc.core.ipc.arena
    for info in infos:
        body = {"items": [{"id": info.id, "offset": 0}], "start": 0, "end": info.num_tokens,
                "ipc": {"host": this_host(), "hold": False}}
        answer = httpx.post(svc.url + "/v1/fetch", json=body, timeout=30).json()["ipc"]
        assert "offsets" in answer, answer
        (offset,) = answer["offsets"]
        dtype = getattr(torch, info.dtype)
        nbytes = info.num_tokens * info.row_width * dtype.itemsize
        on_gpu = arena.memory.bytes[offset:offset + nbytes].view(dtype).view(info.num_tokens, -1)
        assert raw(on_gpu) == raw(socket_rows(svc, [(info.id, 0)], 0, info.num_tokens, info.row_width))


def test_a_consumer_in_the_server_process_gets_the_rows_the_next_way(svc, encoded):
    infos, _ = encoded
    info = infos[0]
    with EncoderClient.http(svc.url, timeout=60) as c:
        out = torch.full((info.num_tokens, info.row_width), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        # (bf16: another dtype than the rows', so the copy goes through a temporary and a cast)
        c.fetch([(info.id, 0)], 0, info.num_tokens, out=out)
        assert raw(out) == raw(socket_rows(svc, [(info.id, 0)], 0, info.num_tokens, info.row_width).bfloat16())
        # CUDA does not open a handle in the process that exported it: the client says why and goes on
        assert c.fetch_paths == {"socket": 1} and c.ipc_off is not None or c.fetch_paths == {"ipc": 1}


@pytest.mark.parametrize("device", DEVICES)
def test_a_consumer_process_copies_the_rows_gpu_to_gpu(svc, encoded, device, tmp_path):
    infos, layout = encoded
    width = infos[0].row_width
    fetches = []
    for size in (7, layout.prompt_len):  # chunks that split images; the whole prompt with its three images
        for start, end in chunks(layout.prompt_len, size):
            items = [(i, o) for i, o, n in layout.items if o < end and start < o + n]
            if items:
                fetches.append(dict(items=items, start=start, end=end))
    answer = consume(dict(url=svc.url, device=device, fetches=fetches), tmp_path)
    for k, f in enumerate(fetches):
        assert (tmp_path / f"{k}.bin").read_bytes() == raw(socket_rows(svc, f["items"], f["start"], f["end"], width))
    if answer["ipc_off"]:
        pytest.skip(f"CUDA IPC refused on this host (the rows came the next way, right): {answer['ipc_off']}")
    assert answer["paths"] == {"ipc": len(fetches)}
    assert svc.sample("encoder_ipc_fetches_total", {"outcome": "held"}) >= len(fetches)


@pytest.mark.parametrize("device", DEVICES)
def test_the_vllm_connector_loads_by_ipc(svc, encoded, device, tmp_path):
    infos, _ = encoded
    fetches = [dict(items=[[i.id, 0]], start=0, end=i.num_tokens) for i in infos]
    answer = consume(dict(url=svc.url, device=device, via="connector", fetches=fetches), tmp_path)
    for k, info in enumerate(infos):
        assert (tmp_path / f"{k}.bin").read_bytes() == raw(socket_rows(svc, [(info.id, 0)], 0, info.num_tokens,
                                                                       info.row_width))
    assert answer["staged"] == ["ipc"] * len(infos)  # nothing staged in host memory
    if answer["ipc_off"]:
        pytest.skip(f"CUDA IPC refused on this host (the worker's rows came the next way, right): "
                    f"{answer['ipc_off']}")
    # the worker copied under the scheduler side's holds: no request of its own
    assert answer["copied"] == len(infos) and not answer["paths"]
