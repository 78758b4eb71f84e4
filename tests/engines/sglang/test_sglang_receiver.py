"""SGLang 0.5.23's own language-side receiver against our real service (--sglang-protocol), on CPU.

Our service: the command docs/sglang.md shows (`encoder-service serve ... --sglang-protocol --sglang-port`), run
from the main venv (a subprocess, as deployed) with a tiny random checkpoint, in bfloat16 as documented.
SGLang: its ServerArgs come from the documented `python -m sglang.launch_server ... --language-only
--encoder-urls ...` parsed by its own parser; then its real code runs: `MMReceiverHTTP` POSTs /encode (the
tokenizer's dispatch), the scheduler-side receiver POSTs /scheduler_receive_url, binds its PULL socket,
reads the push with `safe_pickle_loads` (its allow-list unpickler) and `torch.frombuffer`, reassembles the
parts, and `QwenVLImageProcessor.get_validated_mm_data` expands the prompt's image placeholders and slices the
rows per image (zmq_to_scheduler); `recv_mm_data` does the same for zmq_to_tokenizer. Only the surroundings are
stand-ins: a 1-rank gloo group for the TP status all-reduce and a scheduler object without a model config.

The embeddings SGLang ends up with are compared bit for bit with ours (`/v1/encode` with return_embeddings).
Images as SGLang's own loader would give them to the processor: a photo with an EXIF orientation and an RGBA PNG
(SGLang 0.5.23 applies no orientation and drops the alpha; we turn the photo upright and composite over white,
as vLLM and transformers do, or, with --no-exif-orientation, leave the photo as SGLang's loader does).
Run by scripts/tiers/sglang.sh in its own venv; skipped where SGLang is not installed (the main venv).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import subprocess
import types
import urllib.error
import urllib.request
import uuid
from array import array
from pathlib import Path

import pytest

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # docs: the language side's reachable address
os.environ.setdefault("SGLANG_ENCODER_RECV_TIMEOUT", "60")
# Not plain "sglang": tests/engines is on sys.path (its conftest), so this directory passes for a namespace
# package of that name where SGLang is not installed.
from tests.support.engine_tier import require
from tests.support.waits import wait_for

require("sglang.srt", "scripts/tiers/sglang.sh")

import torch  # noqa: E402

from tests.support import docs_blocks  # noqa: E402
from tests.support.encoder_process import ROOT, ServiceProcess, encoder_service_argv, main_python  # noqa: E402
from tests.support.images import data_url, image_bytes  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
BACKENDS = ("zmq_to_scheduler", "zmq_to_tokenizer")
SIZES = [(100, 60), (57, 131), (224, 200)]  # (w, h): three different grids

pytestmark = pytest.mark.timeout(300)


# ---- our service, as documented -------------------------------------------------------------------------
def http(method: str, url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Encoder(ServiceProcess):
    def __init__(self, model_dir: Path, log_path: Path, *extra: str):
        documented = docs_blocks.command("encoder")
        assert documented.argv[:2] == ["encoder-service", "serve"] and "--sglang-protocol" in documented.argv
        self.sglang_port, self.http_port = free_port(), free_port()
        argv = documented.replaced({"--model": str(model_dir), "--host": "127.0.0.1",
                                    "--sglang-port": str(self.sglang_port)})
        argv += ["--device", "cpu", "--http-port", str(self.http_port), "--grpc-port", "0", "--log-level", "warning",
                 *extra]
        self.url = f"http://127.0.0.1:{self.sglang_port}"  # what --encoder-urls names
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        super().__init__(encoder_service_argv(*argv[1:]), f"{self.url}/health", log_path,
                         name=f"encoder ({model_dir.name})")
        self.wait_ready()

    def rows(self, images: list[bytes]) -> list[torch.Tensor]:
        """Our rows of `images` from /v1/encode (return_embeddings): the reference for SGLang's."""
        status, body = http("POST", f"{self.http_url}/v1/encode", {
            "images": [{"data": base64.b64encode(b).decode()} for b in images], "return_embeddings": True})
        assert status == 200, body
        out = []
        for img in json.loads(body)["images"]:
            e = img["embedding"]
            assert e["dtype"] == "bfloat16"
            out.append(torch.frombuffer(bytearray(base64.b64decode(e["data"])), dtype=torch.bfloat16)
                       .reshape(e["shape"]))
        return out

    def video_rows(self, videos: list[bytes]) -> list[dict]:
        """Our answer for each video of `videos` from /v1/encode (return_embeddings): its VideoInfo JSON with
        `rows`, the reference for SGLang's."""
        status, body = http("POST", f"{self.http_url}/v1/encode", {
            "videos": [{"data": base64.b64encode(b).decode()} for b in videos], "return_embeddings": True})
        assert status == 200, body
        out = []
        for video in json.loads(body)["videos"]:
            e = video.pop("embedding")
            video["rows"] = torch.frombuffer(bytearray(base64.b64decode(e["data"])), dtype=torch.bfloat16).reshape(
                e["shape"])
            out.append(video)
        return out

    def metric(self, sample: str) -> float:
        """A sample of our /metrics (Prometheus text), 0 when absent."""
        status, body = http("GET", f"{self.http_url}/metrics")
        m = re.search(r"^" + re.escape(sample) + r" (\S+)$", body.decode(), re.M)
        return float(m.group(1)) if m else 0.0

    def images_encoded(self) -> float:
        return self.metric("encoder_images_encoded_total")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The model directory both sides load: our tiny random checkpoint with its tokenizer (testing/tiny.py:
    build_tiny_checkpoint, add_tiny_tokenizer), built by the main venv, which serves it."""
    built = {}

    def get(family: str) -> Path:
        if family not in built:
            path = tmp_path_factory.mktemp("models") / family
            code = ("import sys; from encoder_service.testing.tiny import add_tiny_tokenizer, build_tiny_checkpoint; "
                    "add_tiny_tokenizer(build_tiny_checkpoint(sys.argv[1], sys.argv[2]))")
            subprocess.run([main_python(), "-c", code, family, str(path)], check=True, timeout=300, cwd=ROOT)
            built[family] = path
        return built[family]

    return get


@pytest.fixture(scope="session")
def encoder(model_dir, tmp_path_factory):
    running: dict[str, Encoder] = {}

    def get(family: str) -> Encoder:
        if family not in running:  # both stay up (idle between tests): tiny models
            running[family] = Encoder(model_dir(family), tmp_path_factory.mktemp("logs") / f"{family}.log")
        return running[family]

    yield get
    for enc in running.values():
        enc.stop()


@pytest.fixture(scope="session")
def stored_pixels_encoder(model_dir, tmp_path_factory):
    """Qwen2.5-VL with --no-exif-orientation: photos as stored, as SGLang's own loader leaves them."""
    enc = Encoder(model_dir("qwen2_5_vl"), tmp_path_factory.mktemp("logs") / "no-exif.log", "--no-exif-orientation")
    yield enc
    enc.stop()


# ---- SGLang's side, as documented ------------------------------------------------------------------------
def language_argv(model: Path, encoder_urls: list[str], backend: str) -> list[str]:
    """The documented launch_server command with the test's model and encoder URL (same port as documented
    on the encoder side), plus CPU and the transport under test."""
    documented = docs_blocks.command("language")
    assert documented.argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert "--language-only" in documented.argv and set(documented.env) == {"SGLANG_HOST_IP"}
    assert documented.value("--encoder-urls").endswith(":" + docs_blocks.command("encoder").value("--sglang-port"))
    argv = documented.replaced({"--model-path": str(model), "--encoder-urls": encoder_urls})[3:]
    return argv + ["--device", "cpu", "--encoder-transfer-backend", backend]


_GLOO = []


def publish(model: Path, encoder_urls: list[str], backend: str):
    """SGLang's process-wide config from its own parser, as launch_server would have it (scheduler role)."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel, publish as sgl_publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(language_argv(model, encoder_urls, backend))
    assert server_args.language_only and server_args.encoder_urls == encoder_urls
    sgl_publish(server_args, role="scheduler")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    # The TP status all-reduce needs a cpu group: a 1-rank gloo group stands in for the TP group.
    get_parallel().override_permanently(tp_rank=0, pp_rank=0,
                                        tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD))
    return server_args


def hf_config_of(model: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


def noise_png(i: int, seed: int) -> bytes:
    w, h = SIZES[i % len(SIZES)]
    return image_bytes(w, h, seed * 100 + i)



def prompt_for(n: int, pad: str = "<|image_pad|>") -> str:
    img = f"<|vision_start|>{pad}<|vision_end|>"
    return f"<|im_start|>user\n{img * n}Describe.<|im_end|>\n<|im_start|>assistant\n"


def tokenized(obj, prompt: str, tokenizer):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    # What the TokenizerManager hands the scheduler for an EPD request (mm_inputs come from the encoder).
    return TokenizedGenerateReqInput(
        rid=obj.rid, input_text=prompt, input_ids=array("q", tokenizer.encode(prompt)), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(), return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
        need_wait_for_mm_inputs=True, num_items_assigned=obj.num_items_assigned, encoder_urls=obj.encoder_urls)


def via_scheduler(server_args, hf_config, encoder_urls: list[str], images: list[str], prompt: str,
                  media: str = "image_data"):
    """zmq_to_scheduler: (mm_inputs, None) or (None, (message, code)) of SGLang's scheduler-side receiver."""
    from sglang.srt.disaggregation.encoder.receiver import create_mm_receiver
    from sglang.srt.managers.io_struct import GenerateReqInput

    tok_recv = create_mm_receiver(server_args, dtype=torch.bfloat16, hf_config=hf_config, encode_urls=encoder_urls)
    sched_recv = create_mm_receiver(server_args, dtype=torch.bfloat16, hf_config=hf_config,
                                    scheduler=types.SimpleNamespace(model_config=None))
    sched_recv.create_req = lambda r: r  # the real one builds a scheduler Req for the abort path
    try:
        obj = GenerateReqInput(text=prompt, **{media: images}, rid=uuid.uuid4().hex)
        dispatch_errors = []
        ready = tok_recv.send_encode_request(obj, on_dispatch_error=dispatch_errors.append)  # thread: POST /encode
        assert obj.need_wait_for_mm_inputs and ready is not None
        recv_req = tokenized(obj, prompt, tok_recv.mm_processor._tokenizer)
        ready.set()  # the tokenizer sets it once the request is on its way to the scheduler
        pending, got = [recv_req], {}

        def received() -> bool:
            """One turn of the scheduler's receiver on what came since the last (first: the request)."""
            # The TokenizerManager forwards a failed /encode to the scheduler as an EncoderDispatchErrorReq.
            turn = pending + [dispatch_errors.pop() for _ in list(dispatch_errors)]
            pending.clear()
            got["out"], got["aborts"] = sched_recv.process_waiting_requests(turn)  # registers, drains the PULL socket
            return bool(got["out"] or got["aborts"])

        wait_for(received, "SGLang's receiver to get the rows or an abort", 90)
        if got["aborts"]:
            return None, (got["aborts"][0][1], got["aborts"][0][2])
        assert got["out"][0] is recv_req
        return recv_req.mm_inputs, None
    finally:
        sched_recv.scheduler_recv_socket.close(0)


def via_tokenizer(server_args, hf_config, encoder_urls: list[str], images: list[str], prompt: str,
                  media: str = "image_data"):
    """zmq_to_tokenizer: SGLang's recv_mm_data (None when the encoder failed: the TokenizerManager answers 503)."""
    from sglang.srt.disaggregation.encoder.receiver import create_mm_receiver
    from sglang.srt.managers.io_struct import GenerateReqInput

    tok_recv = create_mm_receiver(server_args, dtype=torch.bfloat16, hf_config=hf_config, encode_urls=encoder_urls)
    tok_recv._init_mm_processor(server_args, hf_config)  # the TokenizerManager's own mm processor
    obj = GenerateReqInput(text=prompt, **{media: images}, rid=uuid.uuid4().hex)
    obj.need_wait_for_mm_inputs = True  # TokenizerManager._handle_epd_disaggregation_encode_request
    return asyncio.run(tok_recv.recv_mm_data(obj, tok_recv.mm_processor, prompt))


def run_sglang(backend, model, enc, images, urls=None, *, videos=False):
    """SGLang's receiver for one request: (mm_inputs, None) or (None, error). `urls`: --encoder-urls.
    `videos`: the items are videos (GenerateReqInput.video_data, a video pad each in the prompt)."""
    urls = urls or [enc.url]
    hf_config = hf_config_of(model)
    server_args = publish(model, urls, backend)
    prompt = prompt_for(len(images), "<|video_pad|>" if videos else "<|image_pad|>")
    media = "video_data" if videos else "image_data"
    if backend == "zmq_to_scheduler":
        return via_scheduler(server_args, hf_config, urls, images, prompt, media)
    return via_tokenizer(server_args, hf_config, urls, images, prompt, media), None


def check_embeddings(mm_inputs, ours: list[torch.Tensor], hf_config, family: str):
    from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration

    items = list(mm_inputs.mm_items)
    assert len(items) == len(ours)
    image_tokens = sum(1 for t in mm_inputs.input_ids if t == hf_config.image_token_id)
    assert image_tokens == sum(r.shape[0] for r in ours)  # every placeholder got a row
    hidden = hf_config.text_config.hidden_size
    for i, (item, expect) in enumerate(zip(items, ours)):
        got = item.precomputed_embeddings
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == tuple(expect.shape), (i, got.shape, expect.shape)
        assert torch.equal(got.view(torch.int16), expect.view(torch.int16)), f"image {i}: rows differ"
        if family == "qwen3_vl":  # SGLang's own split of each row into the main and deepstack embeddings
            levels = len(hf_config.vision_config.deepstack_visual_indexes)
            model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden),
                                          num_deepstack_embeddings=levels)
            main, deep = Qwen3VLForConditionalGeneration.separate_deepstack_embeds(model, got)
            assert levels == 3 and main.shape[1] == hidden and deep.shape[1] == levels * hidden
            assert torch.equal(main, expect[:, :hidden]) and torch.equal(deep, expect[:, hidden:])
        else:
            assert got.shape[1] == hidden


# ---- tests -----------------------------------------------------------------------------------------------
def test_header_is_what_sglang_reads():
    """Our hand-built header through SGLang's SafeUnpickler equals what SGLang's own encoder pickles, and names
    only allow-listed globals (found by walking the opcodes: nothing is executed for that)."""
    import pickle
    import pickletools

    from sglang.srt.disaggregation.encoder.receiver import EmbeddingData
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.utils.common import SafeUnpickler, safe_pickle_loads

    from encoder_service.api.sglang import header as hdr

    grid = [[1, 4, 4], [1, 2, 6]]
    ours = hdr.embedding_header("abc_local_part_1", 2, 1, grid, [7, 192], "bfloat16")
    names = []
    strings = []
    for op, arg, _ in pickletools.genops(ours):
        if op.name == "SHORT_BINUNICODE":
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            names.append(tuple(strings[-2:]))
    assert set(names) <= hdr.allowed_globals() <= SafeUnpickler.ALLOWED_GLOBALS
    theirs = EmbeddingData("abc_local_part_1", 2, 1, torch.tensor(grid), Modality.IMAGE,
                           torch.zeros(7, 192, dtype=torch.bfloat16), video_timestamps=None,
                           second_per_grid_ts=None).copy_without_embedding()
    theirs = safe_pickle_loads(pickle.dumps(theirs))  # what SGLang's encoder sends, as its receiver reads it
    mine = safe_pickle_loads(ours)
    assert type(mine) is EmbeddingData and list(vars(mine)) == list(vars(theirs))
    for key, value in vars(theirs).items():
        got = getattr(mine, key)
        assert (torch.equal(torch.as_tensor(got), value) if isinstance(value, torch.Tensor) else got == value), key
    err = safe_pickle_loads(hdr.error_header("abc_local_part_0", 1, 0, "encoder_service: boom", 400))
    assert (err.error_msg, err.error_code, err.embedding) == ("encoder_service: boom", 400, None)
    for dtype in hdr.DTYPES:
        header = hdr.embedding_header("r", 1, 0, grid[:1], [4, 8], dtype)
        assert safe_pickle_loads(header).dtype == getattr(torch, dtype)


def test_health_as_sglang_probes_it(encoder):
    import aiohttp
    from sglang.srt.disaggregation.encoder.receiver import EncoderBootstrapServer

    enc = encoder("qwen2_5_vl")

    async def probe():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            return await EncoderBootstrapServer._probe(None, session, enc.url)  # SGLang's own health probe

    assert asyncio.run(probe()) is True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_bit_for_bit(family, backend, encoder, model_dir):
    enc, model = encoder(family), model_dir(family)
    hf_config = hf_config_of(model)
    for n in (1, 3):
        seed = 100 * FAMILIES.index(family) + 10 * BACKENDS.index(backend) + n  # fresh images each case
        images = [noise_png(i, seed) for i in range(n)]
        mm_inputs, error = run_sglang(backend, model, enc, [data_url(b) for b in images])
        assert error is None and mm_inputs is not None, error
        check_embeddings(mm_inputs, enc.rows(images), hf_config, family)


@pytest.mark.parametrize("backend", BACKENDS)
def test_undecodable_image_fails_the_request(backend, encoder, model_dir):
    enc, model = encoder("qwen2_5_vl"), model_dir("qwen2_5_vl")
    bad = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    mm_inputs, error = run_sglang(backend, model, enc, [bad])
    assert mm_inputs is None
    if backend == "zmq_to_scheduler":  # the request is aborted with our message and status
        message, code = error
        assert "encoder_service: image 0" in message and int(code) == 400, error
    # zmq_to_tokenizer: recv_mm_data returns None and SGLang's TokenizerManager answers 503 for the request


def test_image_sent_twice_is_encoded_once(encoder, model_dir):
    enc, model = encoder("qwen3_vl"), model_dir("qwen3_vl")
    hf_config = hf_config_of(model)
    a, b = noise_png(0, seed=7001), noise_png(1, seed=7001)
    before = enc.images_encoded()
    mm_inputs, error = run_sglang("zmq_to_scheduler", model, enc, [data_url(a), data_url(b), data_url(a)])
    assert error is None
    assert enc.images_encoded() - before == 2  # `a` twice in one request: one encode
    mm_again, error = run_sglang("zmq_to_tokenizer", model, enc, [data_url(b), data_url(a)])
    assert error is None and enc.images_encoded() - before == 2  # a second request: cache hits only
    ours = enc.rows([a, b])
    check_embeddings(mm_inputs, [ours[0], ours[1], ours[0]], hf_config, "qwen3_vl")
    check_embeddings(mm_again, [ours[1], ours[0]], hf_config, "qwen3_vl")


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_encoder_urls_parts_reassembled(backend, encoder, model_dir):
    """Our service listed twice: SGLang splits the images into two parts (`num_parts` 2, `part_idx` 0 and 1,
    distinct part ids) and puts the rows back in order."""
    enc, model = encoder("qwen3_vl"), model_dir("qwen3_vl")
    images = [noise_png(i, seed=8000 + BACKENDS.index(backend)) for i in range(3)]
    urls = [enc.url, enc.url.replace("127.0.0.1", "localhost")]
    encodes = 'encoder_requests_total{method="encode",outcome="ok",transport="sglang"}'
    before = enc.metric(encodes)
    mm_inputs, error = run_sglang(backend, model, enc, [data_url(b) for b in images], urls=urls)
    assert error is None and mm_inputs is not None, error
    assert enc.metric(encodes) - before == 2  # one /encode per part
    check_embeddings(mm_inputs, enc.rows(images), hf_config_of(model), "qwen3_vl")


def video_uri(b: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(b).decode()


def make_clip(kind: str, **args) -> bytes:
    """tests/support/video_cases.py's clip, made by the main venv (PyAV is ours, not SGLang's: its language
    side never decodes a video)."""
    code = ("import sys, json; from tests.support.video_cases import make_clip; "
            "sys.stdout.buffer.write(make_clip(sys.argv[1], **json.loads(sys.argv[2])))")
    return subprocess.run([main_python(), "-c", code, kind, json.dumps(args)], check=True, capture_output=True,
                          timeout=120, cwd=ROOT).stdout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_videos_bit_for_bit_with_the_prompt_and_positions_ours_give(family, backend, encoder, model_dir):
    """Two videos (7 frames each: an odd count) through SGLang's receiver: its prompt (Qwen3-VL: a timestamp,
    vision start, the group's pads and vision end per frame group; Qwen2.5-VL one run of pads), its items'
    rows (bit for bit ours) and its M-RoPE positions are those our reference integration builds from our
    answer (integrations/prompt.py, mrope.py: equal to transformers' in the main suite)."""
    from transformers import AutoTokenizer

    from encoder_service.integrations import VisionTokenIds, expand_image_pads, mrope_position_ids

    enc, model = encoder(family), model_dir(family)
    hf_config = hf_config_of(model)
    seed = FAMILIES.index(family) * 2 + BACKENDS.index(backend)
    videos = [make_clip("mp4_h264", frames=7, width=96 + 32 * seed, height=64, fps=4), make_clip(
        "webm_vp9", frames=7, width=64, height=64 + 32 * seed, fps=8)]
    mm_inputs, error = run_sglang(backend, model, enc, [video_uri(v) for v in videos], videos=True)
    assert error is None and mm_inputs is not None, error
    ours = enc.video_rows(videos)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = expand_image_pads(tokenizer.encode(prompt_for(2, "<|video_pad|>")), [], VisionTokenIds.from_config(
        hf_config), videos=ours, timestamp_tokens=lambda text: tokenizer.encode(text, add_special_tokens=False))
    assert list(mm_inputs.input_ids) == prompt.input_ids.tolist()
    items = list(mm_inputs.mm_items)
    assert len(items) == len(prompt.slots)  # Qwen3-VL: an item per frame group; Qwen2.5-VL: per video
    rows = torch.cat([v["rows"] for v in ours])
    got = torch.cat([item.precomputed_embeddings for item in items])
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), rows.view(torch.int16))
    for item, slot in zip(items, prompt.slots):
        assert [tuple(o) for o in item.offsets] == [(slot.offset, slot.end - 1)]
    expected, _ = mrope_position_ids(prompt, hf_config.vision_config.spatial_merge_size,
                                     tokens_per_second=getattr(hf_config.vision_config, "tokens_per_second", None))
    assert torch.equal(torch.as_tensor(mm_inputs.mrope_positions).reshape(3, -1), expected)


# ---- images as SGLang's own loader gives them ------------------------------------------------------------
def encoded(image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def rotated_photo() -> bytes:
    """A photo (tests/data/rocket.jpg, cropped to 224x168) stored landscape with EXIF Orientation 6, as a phone
    stores a portrait."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(Image.open(ROOT / "tests" / "data" / "rocket.jpg").crop((208, 110, 432, 278)), "JPEG",
                   quality=95, exif=exif)


def rgba_png() -> bytes:
    """Noise whose alpha runs from transparent to opaque across it."""
    import numpy as np
    from PIL import Image

    rgb = np.random.default_rng(31).integers(0, 256, (84, 112, 3), dtype=np.uint8)
    alpha = np.tile(np.linspace(0, 255, 112).astype(np.uint8), (84, 1))[..., None]
    return encoded(Image.fromarray(np.concatenate([rgb, alpha], axis=-1), "RGBA"), "PNG")


def sglang_loaded(data: bytes):
    """The PIL image SGLang 0.5.23's own Qwen-VL processor loads from `data` and gives its image processor
    (`_load_single_item`: `load_image`, then `convert("RGB")`)."""
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor

    return QwenVLImageProcessor._load_single_item(data, Modality.IMAGE)


def received_rows(enc, model, data: bytes) -> torch.Tensor:
    """The rows SGLang's receiver gets for one image (zmq_to_scheduler)."""
    mm_inputs, error = run_sglang("zmq_to_scheduler", model, enc, [data_url(data)])
    assert error is None and mm_inputs is not None, error
    (item,) = mm_inputs.mm_items
    return item.precomputed_embeddings


def test_sglangs_own_loader_applies_no_exif_orientation_and_drops_the_alpha():
    """What the tests below and docs/sglang.md rely on about SGLang 0.5.23: a photo stays as stored (vLLM and
    transformers' load_image turn it upright), and an RGBA image loses its alpha without compositing (vLLM and
    the processors put it over white). A new SGLang that changes either fails here."""
    import numpy as np
    from PIL import Image

    photo, rgba = rotated_photo(), rgba_png()
    assert sglang_loaded(photo).size == Image.open(io.BytesIO(photo)).size == (224, 168)
    assert np.array_equal(np.asarray(sglang_loaded(rgba)), np.asarray(Image.open(io.BytesIO(rgba)).convert("RGB")))


def test_photo_as_stored_with_no_exif_orientation(stored_pixels_encoder, model_dir):
    """--no-exif-orientation: our rows of the photo are those of the pixels SGLang's own loader gives (our
    processor is transformers', bit for bit: the main suite), sent losslessly as a PNG."""
    photo = rotated_photo()
    enc, model = stored_pixels_encoder, model_dir("qwen2_5_vl")
    (expect,) = enc.rows([encoded(sglang_loaded(photo), "PNG")])
    got = received_rows(enc, model, photo)
    assert got.shape == expect.shape and got.shape[0] == 48  # (224 / 28) x (168 / 28) merged tokens
    assert torch.equal(got.view(torch.int16), expect.view(torch.int16))


def test_by_default_the_photo_upright_and_alpha_over_white(encoder, model_dir):
    """The default: SGLang's loader followed by what vLLM and transformers do more (the EXIF orientation;
    the alpha composited over white, not dropped): our rows are those of that image."""
    from PIL import Image, ImageOps

    enc, model = encoder("qwen2_5_vl"), model_dir("qwen2_5_vl")
    photo, rgba = rotated_photo(), rgba_png()
    white = Image.new("RGBA", (112, 84), (255, 255, 255, 255))
    upright = {photo: ImageOps.exif_transpose(Image.open(io.BytesIO(photo))).convert("RGB"),
               rgba: Image.alpha_composite(white, Image.open(io.BytesIO(rgba))).convert("RGB")}
    for data, image in upright.items():
        (expect,) = enc.rows([encoded(image, "PNG")])
        got = received_rows(enc, model, data)
        assert torch.equal(got.view(torch.int16), expect.view(torch.int16))
        (as_sglang,) = enc.rows([encoded(sglang_loaded(data), "PNG")])  # the pixels SGLang's loader gives
        assert as_sglang.shape != got.shape or not torch.equal(as_sglang, got)
