"""The examples of README.md and docs/vllm.md, run as written against real servers: the README's encode requests
(curl: multipart, binary, JSON; of images and of videos), its fetch and release (curl), its client loops (HTTP,
gRPC, shared memory), its chunked prefill of a video (a tiny checkpoint for the model named), and docs/vllm.md's
chat requests, of an image and of a video (curl, through `encoder-service vllm-proxy` to a stand-in vLLM). The one
edit: the documented addresses become the test servers' (tests/support/docs_blocks.py reads the
`<!-- docs-test: NAME -->` blocks); the prefill's offline variant runs against the demo checkpoint, with no
download.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.clients import sync_client
from tests.support.docs_blocks import README, VLLM_DOC, block
from tests.support.encoder_process import ServiceProcess, encoder_service_argv
from tests.support.images import image_bytes
from tests.support.ports import free_port
from tests.support.service import AUTH_TOKEN, running
from tests.support.vllm_docs import documented
from tests.support.vllm_stand_in import CHUNKS, StandInVllm

pytestmark = pytest.mark.timeout(180)
DOC_HTTP, DOC_GRPC, DOC_PROXY = "http://127.0.0.1:8000", "127.0.0.1:50051", "http://127.0.0.1:8100"
ARG_MAX_ONE = 128 * 1024  # Linux's limit on one command-line argument (MAX_ARG_STRLEN)


def example_files(directory: Path) -> dict[str, bytes]:
    """The files the examples name, written into `directory`: photo.jpg, large enough that its base64 is over
    the limit on one command-line argument (as a real photo's is), and diagram.png."""
    files = {"photo.jpg": image_bytes(480, 360, seed=1801, fmt="JPEG"), "diagram.png": image_bytes(96, 64, seed=1802)}
    assert len(files["photo.jpg"]) * 4 / 3 > ARG_MAX_ONE
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


def documented_block(name: str, doc: Path, address: str, actual: str) -> str:
    text = block(name, doc)
    assert address in text, f"{doc.name} {name}: the example no longer uses {address}"
    return text.replace(address, actual)


def run_shell(script: str, cwd: Path) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr}"
    return done.stdout


def test_readme_encode_requests(service, tmp_path):
    files = example_files(tmp_path)
    answers = {name: json.loads(run_shell(documented_block(name, README, DOC_HTTP, service.url), tmp_path))
               for name in ("encode-multipart", "encode-binary", "encode-json")}
    with sync_client(service, "http") as client:
        photo, diagram = client.encode([files["photo.jpg"], files["diagram.png"]])
    multipart = answers["encode-multipart"]["images"]
    assert [(i["id"], tuple(i["grid_thw"])) for i in multipart] == [(photo.id, photo.grid_thw),
                                                                    (diagram.id, diagram.grid_thw)]
    for name in ("encode-binary", "encode-json"):
        (image,) = answers[name]["images"]
        assert image["id"] == "u:photo-1" and tuple(image["grid_thw"]) == photo.grid_thw, name
        assert image["num_tokens"] == photo.num_tokens
    # The answer the README shows has exactly the fields the service answers.
    shown = re.search(r'Each answers `(\{"images": \[\{.*?\}\])', README.read_text(), re.S).group(1)
    assert set(re.findall(r'"(\w+)":', shown)) - {"images"} == set(multipart[0])


def test_readme_fetch_and_release(service, tmp_path):
    """The README's fetch (octet-stream and safetensors) and release of the image its JSON example encoded."""
    from safetensors.torch import load_file

    from encoder_service.protocol import wire

    example_files(tmp_path)
    run_shell(documented_block("encode-json", README, DOC_HTTP, service.url), tmp_path)
    released = json.loads(run_shell(documented_block("fetch-release", README, DOC_HTTP, service.url), tmp_path))
    assert released == {"released": 1, "invalid": []}
    with sync_client(service, "http") as client:  # released: still cached, an ordinary LRU entry
        expect = client.fetch([("u:photo-1", 5)], 0, 2048)
    header, rows = wire.decode_http((tmp_path / "rows.bin").read_bytes())
    assert list(header.segments) == list(expect.segments) and expect.segments[0].position == 5
    assert torch.equal(rows, expect.rows)
    assert torch.equal(load_file(tmp_path / "rows.safetensors")["rows"], expect.rows)


def run_python(code: str, namespace: dict, name: str) -> dict:
    exec(compile(code, f"README.md, docs-test {name}", "exec"), namespace)
    return namespace


def check_embeds(svc, namespace: dict) -> None:
    """The example's `embeds`: the image's rows at positions 5.., zeros elsewhere (its text)."""
    (info,), embeds, prompt_len = namespace["infos"], namespace["embeds"], namespace["prompt_len"]
    n = info.num_tokens
    assert embeds.shape == (prompt_len, info.row_width)
    assert 5 + n <= 2048 < prompt_len  # chunks of 2048: the image's, then one of text only (rows None)
    with sync_client(svc, "http") as client:
        rows = client.fetch([(info.id, 0)], 0, n).rows
    assert torch.equal(embeds[5:5 + n], rows.to(embeds.dtype))
    assert not embeds[:5].any() and not embeds[5 + n:].any()


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_readme_client_loop(service, transport, tmp_path, monkeypatch):
    example_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # the example reads photo.jpg
    if transport == "http":
        code = documented_block("client", README, DOC_HTTP, service.url)
    else:  # the example's own comment: EncoderClient.grpc("127.0.0.1:50051")
        code = documented_block("client", README, f'EncoderClient.http("{DOC_HTTP}")',
                                f'EncoderClient.grpc("{service.grpc_address}")')
    check_embeds(service, run_python(code, {}, "client"))


@pytest.fixture(scope="module")
def shm_default_dir_service(request, tiny_checkpoint):
    """--shm-fetch with the default --shm-dir, /dev/shm, as the README's shared-memory example assumes."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    return running(request, tiny_checkpoint("qwen2_5_vl"), "--shm-fetch")


def test_readme_shared_memory_loop(shm_default_dir_service, tmp_path, monkeypatch):
    svc = shm_default_dir_service
    example_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    namespace = run_python(documented_block("client", README, DOC_HTTP, svc.url), {}, "client")
    run_python(documented_block("client-shm", README, DOC_GRPC, svc.grpc_address), namespace, "client-shm")
    check_embeds(svc, namespace)
    assert not svc.pinned(namespace["infos"][0].id)  # the example released it


def through_documented_proxy(block_name: str, service, tmp_path: Path) -> tuple[str, dict]:
    """(the answer, the body vLLM got) of docs/vllm.md's request `block_name`, run in `tmp_path` through the
    documented proxy command, to a stand-in vLLM."""
    vllm = StandInVllm()
    port = free_port()
    argv = documented("proxy").replaced({"--encoder-url": service.url, "--vllm-url": vllm.url,
                                         "--host": "127.0.0.1", "--port": str(port), "--auth-token": AUTH_TOKEN})
    proxy = ServiceProcess(encoder_service_argv(*argv[1:], python=sys.executable), f"http://127.0.0.1:{port}/health",
                           tmp_path / "proxy.log", name="vllm-proxy")
    try:
        proxy.wait_ready(120)
        answer = run_shell(documented_block(block_name, VLLM_DOC, DOC_PROXY, f"http://127.0.0.1:{port}"),
                           tmp_path)
    finally:
        proxy.stop()
        vllm.shutdown()
    (forwarded,) = vllm.bodies
    return answer, forwarded


def test_vllm_doc_chat_request(auth_service, tmp_path):
    """docs/vllm.md's request, through the documented proxy command, with a photo whose base64 is too long to
    be one command-line argument (the example inlined it once: "Argument list too long")."""
    files = example_files(tmp_path)
    answer, forwarded = through_documented_proxy("chat-request", auth_service, tmp_path)
    events = [e for e in answer.split("\n\n") if e]
    assert len(events) == CHUNKS + 1 and events[-1] == "data: [DONE]", answer[:500]
    with sync_client(auth_service, "http", token=AUTH_TOKEN) as client:
        (photo,) = client.encode([files["photo.jpg"]])
    assert forwarded["messages"][0]["content"][0] == {
        "type": "image_embeds", "image_embeds": {"image_grid_thw": list(photo.grid_thw)}, "uuid": photo.id}


def test_vllm_doc_chat_video_request(auth_service, tmp_path):
    """docs/vllm.md's video request (the encoder's family here: Qwen2-VL, whose part is the grid alone)."""
    files = video_files(tmp_path)
    answer, forwarded = through_documented_proxy("chat-video-request", auth_service, tmp_path)
    assert json.loads(answer)["choices"][0]["message"]["content"] == "ok"
    with sync_client(auth_service, "http", token=AUTH_TOKEN) as client:
        (clip,) = client.encode_videos([files["clip.mp4"]], fps=2)
    assert forwarded["messages"][0]["content"][0] == {
        "type": "video_embeds", "video_embeds": {"video_grid_thw": list(clip.video_grid_thw)}, "uuid": clip.id}
    assert clip.num_frames == 4 and "mm_processor_kwargs" not in forwarded


def video_files(directory: Path) -> dict[str, bytes]:
    """The files the README's video examples name: clip.mp4 (12 frames at 8 fps: fps=2 samples 4), frame0.png,
    frame1.png."""
    from tests.support.video_cases import frame_images, make_clip

    files = {"clip.mp4": make_clip("mp4_h264", frames=12, width=128, height=96, fps=8)}
    files.update(zip(("frame0.png", "frame1.png"), frame_images(2, height=64, width=96)))
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


def test_readme_video_requests(service, tmp_path):
    files = video_files(tmp_path)
    answers = {name: json.loads(run_shell(documented_block(name, README, DOC_HTTP, service.url), tmp_path))
               for name in ("video-multipart", "video-binary", "video-json")}
    with sync_client(service, "http") as client:
        (clip,) = client.encode_videos([files["clip.mp4"]], fps=2)
    (multipart,) = answers["video-multipart"]["videos"]
    assert multipart["id"] == clip.id and multipart["num_frames"] == 4
    assert multipart["sampled_fps"] == pytest.approx(4 / 12 * 8)  # transformers' VideoMetadata.sampled_fps
    assert multipart["second_per_grid_t"] == pytest.approx(2 / multipart["sampled_fps"])
    (binary,) = answers["video-binary"]["videos"]
    named, frames = answers["video-json"]["videos"]
    assert binary["id"] == named["id"] == "v:u:clip-1" and binary["video_grid_thw"] == multipart["video_grid_thw"]
    assert frames["num_frames"] == 2 and frames["sampled_fps"] == 1
    # The answer the README shows has exactly the fields the service answers.
    shown = re.search(r'before the ViT runs, `(\{"videos": \[\{.*?\}\])', README.read_text(), re.S).group(1)
    assert set(re.findall(r'"(\w+)":', shown)) - {"videos"} == set(multipart)


@pytest.fixture(scope="module")
def service_with_tokenizer(request, tiny_checkpoint, tmp_path_factory):
    """qwen2_5_vl with the tiny tokenizer beside it (the README's prefill loads both from its checkpoint)."""
    import shutil

    from encoder_service.testing.tiny import add_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenized") / "qwen2_5_vl"
    shutil.copytree(tiny_checkpoint("qwen2_5_vl"), path)
    return running(request, add_tiny_tokenizer(path))


def test_readme_video_prefill(service_with_tokenizer, tmp_path, monkeypatch):
    svc = service_with_tokenizer
    video_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # the example reads clip.mp4
    code = documented_block("video-prefill", README, DOC_HTTP, svc.url)
    code = code.replace('"Qwen/Qwen2.5-VL-7B-Instruct"', repr(str(svc.checkpoint)))
    namespace = run_python(code, {}, "video-prefill")
    video, result = namespace["video"], namespace["result"]
    assert video.num_groups == 2 and isinstance(namespace["next_token"], str)
    assert sum(c.rows_received for c in result.chunks) == video.num_tokens
    assert result.logits.shape[0] == namespace["prompt"].seq_len
    assert not svc.pinned(video.group_id(0))  # the example released it


def test_readme_video_prefill_offline(request, tmp_path, monkeypatch):
    """The offline variant: the demo checkpoint as `scripts/serve.sh` builds and serves it (demo:qwen2_5_vl
    under .demo/), the README's tokenizer line in place of the example's checkpoint line, no download."""
    from encoder_service.cli import resolve_demo_model
    from encoder_service.settings import Settings

    demo = resolve_demo_model(Settings.from_args(["--model", "demo:qwen2_5_vl"], env={}), root=tmp_path / ".demo")
    svc = running(request, Path(demo.model.model))
    video_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # the repository's root, as the README says: .demo/ and clip.mp4 are here
    example = documented_block("video-prefill", README, DOC_HTTP, svc.url)
    line = '\ncheckpoint = "Qwen/Qwen2.5-VL-7B-Instruct"  # or a Qwen3-VL checkpoint: the same code\n'
    assert line in example, "the example's checkpoint line changed: the offline variant replaces it"
    code = example.replace(line, "\n" + block("video-prefill-offline", README) + "\n")
    namespace = run_python(code, {}, "video-prefill-offline")
    video, result = namespace["video"], namespace["result"]
    assert namespace["checkpoint"] == ".demo/qwen2_5_vl"  # the demo's, where serve.sh built it
    assert video.num_groups == 2 and isinstance(namespace["next_token"], str)
    assert sum(c.rows_received for c in result.chunks) == video.num_tokens
