"""The SGLang protocol's pieces on their own (api/sglang/): the hand-built push header, read back here by a
symbolic walker of its opcodes (nothing is unpickled: `pickle` is never imported), the part table, the
mm_items strings, the receive addresses. SGLang's own unpickler reads the same bytes in
tests/engines/sglang/ (the authoritative check)."""

from __future__ import annotations

import asyncio
import base64
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from encoder_service import errors
from encoder_service.api.sglang import header as hdr
from encoder_service.api.sglang.http import EncodeBody, image_input, validate_encode, video_aux, video_input
from encoder_service.api.sglang.session import Sessions
from encoder_service.settings import Settings, SettingsError
from tests.support.sglang_header import globals_in, walk

ROOT = Path(__file__).resolve().parents[2]

# Our header for req_id "r_local_part_0", 1 part, grid [1, 4, 6], shape [6, 256], bfloat16, as checked once
# against SGLang 0.5.23: its safe_pickle_loads read these bytes into the same EmbeddingData, field for field,
# that its own encoder sends (the engine tier, tests/engines/sglang/, checks that on every CI run). A change
# here changes the wire.
GOLDEN = (
    b"\x80\x04\x8c*sglang.srt.disaggregation.encoder.receiver\x8c\rEmbeddingData\x93)\x81}(\x8c\x06req_id"
    b"\x8c\x0er_local_part_0\x8c\tnum_partsK\x01\x8c\x08part_idxK\x00\x8c\x08grid_dim](](K\x01K\x04K\x06ee"
    b"\x8c\x08modality\x8c\x1esglang.srt.multimodal.modality\x8c\x08Modality\x93K\x01\x85R\x8c\tembeddingN"
    b"\x8c\tsend_timeN\x8c\x05dtype\x8c\x05torch\x8c\x08bfloat16\x93\x8c\x05shape](K\x06M\x00\x01e\x8c\x07_mr_ptrN"
    b"\x8c\terror_msgN\x8c\nerror_codeN\x8c\x10video_timestampsN\x8c\x12second_per_grid_tsNub.")


def test_header_matches_the_golden_bytes():
    assert hdr.embedding_header("r_local_part_0", 1, 0, [(1, 4, 6)], [6, 256], "bfloat16") == GOLDEN


def test_header_fields_and_globals():
    data = hdr.embedding_header("abc_local_part_1", 3, 1, [(1, 4, 6), (1, 10, 2)], [11, 192], "float32")
    kind, cls, state = walk(data)
    assert (kind, cls) == ("new", hdr.EMBEDDING_DATA)
    assert list(state) == ["req_id", "num_parts", "part_idx", "grid_dim", "modality", "embedding", "send_time",
                           "dtype", "shape", "_mr_ptr", "error_msg", "error_code", "video_timestamps",
                           "second_per_grid_ts"]  # EmbeddingData.__dict__ of SGLang's own encoder, in order
    assert state["req_id"] == "abc_local_part_1" and (state["num_parts"], state["part_idx"]) == (3, 1)
    assert state["grid_dim"] == [[1, 4, 6], [1, 10, 2]] and state["shape"] == [11, 192]
    assert state["modality"] == ("call", hdr.MODALITY, (1,))
    assert state["dtype"] == ("torch", "float32")
    assert all(state[k] is None for k in ("embedding", "send_time", "_mr_ptr", "error_msg", "error_code"))
    assert globals_in((cls, state)) <= hdr.allowed_globals()


def test_no_pickle_anywhere_in_the_adapter():
    """The adapter writes pickle bytes by hand and never reads any: no module of it touches `pickle`."""
    for path in (ROOT / "encoder_service" / "api" / "sglang").glob("*.py"):
        code = "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#"))
        assert not re.search(r"import\s+(c?pickle|pickletools|dill|marshal)|from\s+(c?pickle|dill)\b|\bloads\(",
                             code), path


def test_error_header():
    kind, cls, state = walk(hdr.error_header("x_local_part_0", 2, 1, "encoder_service: image 0: bad " * 20, 400))
    assert state["error_msg"].startswith("encoder_service: image 0") and len(state["error_msg"]) > 255  # X opcode
    assert state["error_code"] == 400 and type(state["error_code"]) is int
    assert state["grid_dim"] is None and state["dtype"] is None and state["shape"] is None
    assert "send_time" in state and "video_timestamps" not in state  # as SGLang's encoder's error part
    assert globals_in((cls, state)) <= hdr.allowed_globals()


@pytest.mark.parametrize("v", [0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40])
def test_header_integers(v):
    _, _, state = walk(hdr.embedding_header("r", 1, 0, [(1, 2, 2)], [v, 8], "float16"))
    assert state["shape"] == [v, 8]


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="int8"), "dtype"), (dict(shape=[4]), "shape"), (dict(part_idx=2), "part_idx"),
    (dict(req_id=""), "req_id"), (dict(grid=[(1, 2)]), "grid"), (dict(num_parts=True), "int"),
])
def test_header_refuses_what_sglang_would_reject(kwargs, message):
    args = dict(req_id="r", num_parts=2, part_idx=0, grid=[(1, 2, 2)], shape=[1, 8], dtype="bfloat16") | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        hdr.embedding_header(args["req_id"], args["num_parts"], args["part_idx"], args["grid"], args["shape"],
                             args["dtype"])


# ---- mm_items --------------------------------------------------------------------------------------------
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 20


def test_items_inline_and_url():
    b64 = base64.b64encode(PNG).decode()
    assert image_input(0, "data:image/png;base64," + b64).data == PNG
    assert image_input(0, b64).data == PNG
    assert image_input(0, {"url": b64, "content_hash": "abc", "detail": "high"}).data == PNG
    assert image_input(0, "https://img.example/a.png").url == "https://img.example/a.png"  # the core's fetcher
    jpeg_b64 = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\x00" * 8).decode()
    assert jpeg_b64.startswith("/9j/") and image_input(0, jpeg_b64).data.startswith(b"\xff\xd8")  # not a path


@pytest.mark.parametrize("item, message", [
    ("/etc/passwd", "local file paths are never read"),
    ("file:///etc/hosts", "local file paths are never read"),
    ("images/cat.png", "local file paths are never read"),
    ("data:image/png,rawbytes", "data:<mime>;base64"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ({"detail": "high"}, "needs a string 'url'"),
    ({"url": "aGk=", "preprocess_kwargs": {"max_pixels": 1}}, "not supported"),
])
def test_items_refused(item, message):
    with pytest.raises(errors.InvalidInput, match=message):
        image_input(3, item)


@pytest.mark.parametrize("change, message", [
    (dict(req_id=""), "req_id"), (dict(modality="TEXT"), "modality must be one of"),
    (dict(modality="AUDIO"), "images and videos"), (dict(mm_items=[]), "mm_items"), (dict(num_parts=0), "num_parts"),
    (dict(part_idx=1), "part_idx"), (dict(embedding_port=5000, prefill_host=None), "prefill_host"),
    (dict(embedding_port=5000, prefill_host="bad host!"), "bad host"),
])
def test_encode_body_validation(change, message):
    body = dict(req_id="r_local_part_0", mm_items=["aGk="], num_parts=1, part_idx=0, modality="IMAGE") | change
    with pytest.raises(errors.InvalidInput, match=message):
        validate_encode(EncodeBody(**body))


def test_receive_addresses():
    from encoder_service.api.sglang.push import endpoint

    assert endpoint("127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert endpoint("[::1]:5557") == "tcp://[::1]:5557"
    assert endpoint("::1:5557") == "tcp://[::1]:5557"  # prefill_host as a bare IPv6 address
    assert endpoint("prefill-0.llm.svc:6000") == "tcp://prefill-0.llm.svc:6000"
    for bad in ("127.0.0.1", "host:0", "host:99999", ":5557", "a;b:1", "tcp://x:1"):
        with pytest.raises(errors.InvalidInput):
            endpoint(bad)


# ---- the part table --------------------------------------------------------------------------------------
class Clock:
    t = 0.0

    def __call__(self):
        return self.t


async def test_registration_before_and_after_encode():
    table = Sessions(ttl_s=10)
    early = table.register("a", "h:1", 2)  # a rank registers before /encode
    assert table.open_encode("a") is early
    waiting = asyncio.ensure_future(table.wait_registered(early))
    await asyncio.sleep(0)
    assert not waiting.done()
    table.register("a", "h:1", 2)  # the same rank again: no new destination
    await asyncio.sleep(0)
    assert not waiting.done()
    table.register("a", "h:2", 2)
    assert await waiting == ["h:1", "h:2"]
    table.finish(early)
    assert table.get("a") is None and len(table) == 0
    table.open_encode("b")
    with pytest.raises(errors.Conflict, match="duplicate"):
        table.open_encode("b")


async def test_table_is_bounded_in_time_and_size():
    clock = Clock()
    table = Sessions(ttl_s=5, max_parts=3, clock=clock)
    for name in "abc":
        table.register(name, "h:1", 1)
    with pytest.raises(errors.Overloaded):
        table.register("d", "h:1", 1)
    table.fail(table.get("b"), b"err")  # a tombstone gives its place to a new part
    table.register("d", "h:1", 1)
    assert table.get("b") is None and len(table) == 3
    clock.t = 5.0
    assert table.get("a") is None and len(table) == 0  # past the TTL: gone
    part = table.open_encode("e")
    clock.t = 10.0
    with pytest.raises(errors.DeadlineExceeded, match="0 of \\? language-server ranks"):
        await table.wait_registered(part)
    with pytest.raises(errors.InvalidInput, match="receive_count"):
        table.register("f", "h:1", 0)


def test_settings_switch_and_port():
    s = Settings.from_args(["--model", "m"], env={})
    assert s.server.sglang_protocol is False and s.server.sglang_port == 8100
    s = Settings.from_args(["--model", "m"], env={"ENCODER_SGLANG_PROTOCOL": "true", "ENCODER_SGLANG_PORT": "9100"})
    assert s.server.sglang_protocol is True and s.server.sglang_port == 9100
    assert Settings.from_args(["--model", "m", "--sglang-protocol"], env={}).server.sglang_protocol is True
    assert Settings.from_args(["--model", "m", "--no-sglang-protocol"],
                              env={"ENCODER_SGLANG_PROTOCOL": "1"}).server.sglang_protocol is False
    for args in (["--sglang-port", "0"], ["--sglang-port", "8000"], ["--sglang-port", "50051"]):
        with pytest.raises(SettingsError, match="--sglang-port"):
            Settings.from_args(["--model", "m", "--sglang-protocol", *args], env={})


async def test_without_pyzmq_the_service_refuses_to_start(monkeypatch):
    """--sglang-protocol without pyzmq: a SettingsError naming the fix, before any model is loaded."""
    from encoder_service.api import service as service_mod

    monkeypatch.setitem(sys.modules, "zmq", None)  # `import zmq` raises ImportError
    monkeypatch.setitem(sys.modules, "zmq.asyncio", None)
    monkeypatch.setattr(service_mod, "build_core", lambda *a, **k: pytest.fail("the model must not load"))
    settings = Settings.from_args(["--model", "m", "--device", "cpu", "--sglang-protocol"], env={})
    with pytest.raises(SettingsError, match=r"needs pyzmq.*pip install 'pyzmq>=25.1.2'.*pip install -e '\.\[sglang\]'"):
        await service_mod.Service(settings).start()


def test_video_part_header_carries_the_metadata():
    """A VIDEO part: Modality(2), a grid per video, and Qwen3-VL's group times or Qwen2.5-VL's seconds per
    group, as floats (BINFLOAT: no global needed)."""
    qwen3 = hdr.embedding_header("v_local_part_0", 1, 0, [(3, 4, 6), (2, 4, 4)], [26, 192], "bfloat16", "VIDEO",
                                 aux={"video_timestamps": [[0.25, 1.25, 2.0], [0.5, 1.5]]})
    _, cls, state = walk(qwen3)
    assert state["modality"] == ("call", hdr.MODALITY, (2,)) and state["grid_dim"] == [[3, 4, 6], [2, 4, 4]]
    assert state["video_timestamps"] == [[0.25, 1.25, 2.0], [0.5, 1.5]] and state["second_per_grid_ts"] is None
    assert globals_in((cls, state)) <= hdr.allowed_globals()
    _, _, state = walk(hdr.embedding_header("v", 1, 0, [(2, 2, 2)], [2, 8], "float32", "VIDEO",
                                            aux={"second_per_grid_ts": [1 / 12]}))
    assert state["second_per_grid_ts"] == [1 / 12] and state["video_timestamps"] is None
    with pytest.raises(ValueError, match="aux attributes"):
        hdr.embedding_header("v", 1, 0, [(2, 2, 2)], [2, 8], "float32", "VIDEO", aux={"fps": [2.0]})


def test_video_items_and_their_options():
    data = base64.b64encode(b"mp4 bytes").decode()
    assert video_input(0, "data:video/mp4;base64," + data).data == b"mp4 bytes"
    assert video_input(0, {"url": "http://h/a.mp4"}).url == "http://h/a.mp4"
    item = video_input(1, {"url": data, "preprocess_kwargs": {"fps": 1.0, "max_pixels": 1000}, "detail": "auto"})
    assert (item.data, item.fps, item.max_pixels) == (b"mp4 bytes", 1.0, 1000)
    with pytest.raises(errors.InvalidInput, match=r"mm_items\[2\]: per-item options \['preprocess_kwargs.crop'\]"):
        video_input(2, {"url": data, "preprocess_kwargs": {"crop": 1}})
    with pytest.raises(errors.InvalidInput, match="local file paths are never read .send the video inline"):
        video_input(0, "/data/clip.mp4")
    qwen3 = [SimpleNamespace(group_timestamps=(0.25, 1.0), second_per_grid_t=None)]
    assert video_aux(qwen3) == {"video_timestamps": [[0.25, 1.0]]}
    qwen2_5 = [SimpleNamespace(group_timestamps=None, second_per_grid_t=0.5)] * 2
    assert video_aux(qwen2_5) == {"second_per_grid_ts": [0.5, 0.5]}
