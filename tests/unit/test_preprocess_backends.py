"""The preprocessing backends (preprocessing/backends.py) in the main venv, which has no torchvision.

The torchvision backend on the CPU: deterministic, thread-safe, the PIL backend's layout and shapes, apart from it
only by resize rounding (its bit-for-bit parity with transformers' torchvision processor needs torchvision:
tests/engines/test_torchvision_processor.py, run by scripts/tiers/torchvision.sh). The nvJPEG path's dispatch with a
stand-in decoder (the real one needs CUDA: tests/gpu). Limits before any decode, for every backend. Settings,
fingerprints, and the core serving with each backend.
"""

from __future__ import annotations

import io
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_service.api.service import build_core
from encoder_service.cache import model_fingerprint
from encoder_service.core import ImageInput
from encoder_service.errors import ImageDecodeError, LimitExceeded
from encoder_service.preprocessing import (
    ImageLimits,
    PreprocessConfig,
    TorchvisionBackend,
    make_backend,
    probe,
    torch_ops,
)
from encoder_service.preprocessing.nvjpeg import NvJpegDecoder
from encoder_service.settings import PREPROCESS_ALIASES, PREPROCESS_BACKENDS, Settings, SettingsError
from tests.support.images import png_header_only
from tests.support.preprocess_cases import (
    BAD_INPUTS,
    CASES,
    DATA,
    HUB_CONFIGS,
    IMAGES,
    JPEGS,
    LIMITS,
    QWEN2_5,
    cmyk_jpeg,
    encode,
    exif_jpeg,
    multi_picture_jpeg,
    orientation_exif,
    rgb_image,
)
from tests.support.reference import assert_close, reference_rows
from tests.support.service import make_settings


@pytest.fixture(params=sorted(HUB_CONFIGS), scope="module")
def cfg(request) -> PreprocessConfig:
    return PreprocessConfig.default_for(HUB_CONFIGS[request.param][0])


def backends(cfg: PreprocessConfig):
    return make_backend("pil", cfg, LIMITS, "cpu"), make_backend("torchvision", cfg, LIMITS, "cpu")


def level(cfg: PreprocessConfig) -> float:
    """One uint8 level in pixel_values (the smallest scale over the channels)."""
    return 1 / (255 * max(cfg.image_std))


# ---- the torchvision backend on the CPU ----


@pytest.mark.parametrize("name", sorted(CASES))
def test_torchvision_backend_is_the_pil_backend_up_to_resize_rounding(name, cfg):
    pil, tv = backends(cfg)
    data = CASES[name]()
    ours, theirs = tv.preprocess(data), pil.preprocess(data)
    assert (ours.grid_thw, ours.num_tokens) == (theirs.grid_thw, theirs.num_tokens)
    assert ours.pixel_values.dtype == torch.float32 and ours.pixel_values.device.type == "cpu"
    assert ours.pixel_values.shape == theirs.pixel_values.shape
    diff = (ours.pixel_values - theirs.pixel_values).abs() / level(cfg)  # in uint8 levels
    assert diff.mean() < 0.5 and diff.max() < 16, (diff.mean().item(), diff.max().item())


def test_without_resize_only_the_normalization_rounds_differently(cfg):
    """Sides already multiples of the factor: no interpolation in either backend, so the layout (patchify) and
    the normalization agree to the last bit or two ((x - 255m) / (255s) vs (x / 255 - m) / s)."""
    pil, tv = backends(cfg)
    data = encode(rgb_image(cfg.factor * 10, cfg.factor * 14), "PNG")
    assert tv.preprocess(data).grid_thw == (1, 20, 28)
    torch.testing.assert_close(tv.preprocess(data).pixel_values, pil.preprocess(data).pixel_values, rtol=0, atol=1e-6)


def test_torchvision_backend_is_deterministic_across_threads(cfg):
    _, tv = backends(cfg)
    inputs = [make() for make in CASES.values()]
    alone = [tv.preprocess(data).pixel_values for data in inputs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda data: tv.preprocess(data).pixel_values, inputs * 2))
    assert all(torch.equal(a, b) for a, b in zip(alone * 2, together))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_to_the_tower_dtype_equals_casting_after(dtype, cfg):
    for backend in backends(cfg):
        for data in ((DATA / "rocket.jpg").read_bytes(), IMAGES["rgba_png"]()):
            cast = backend.preprocess(data).pixel_values.to(dtype)
            assert torch.equal(backend.preprocess(data, dtype).pixel_values, cast)


def test_patchify_is_merge_block_order():
    """Row k of the patches of a merged token: its (m x m) patches row by row; each row C, T, P, P."""
    cfg = PreprocessConfig.default_for(QWEN2_5)
    p, m = cfg.patch_size, cfg.merge_size
    image = torch.arange(3 * 2 * p * m * p * m, dtype=torch.float32).reshape(3, 2 * p * m, p * m)
    rows = torch_ops.patchify(image, cfg)
    assert rows.shape == (2 * m * m, 3 * 2 * p * p) and rows.is_contiguous()
    second_token_top_right = image[:, p * m : p * m + p, p : 2 * p]  # merged row 1, patch (0, 1)
    assert torch.equal(rows[m * m + 1].reshape(3, 2, p, p)[:, 1], second_token_top_right)
    assert torch.equal(rows[m * m + 1].reshape(3, 2, p, p)[:, 0], second_token_top_right)  # T repeats the frame


# ---- limits and bad input: before any decode, every backend ----


@pytest.mark.parametrize("name", PREPROCESS_BACKENDS)
def test_limits_are_checked_from_the_header_before_decoding(name):
    backend = make_backend(name, PreprocessConfig.default_for(QWEN2_5), LIMITS, "cpu")
    with pytest.raises(LimitExceeded, match="decoded pixel count of the 9000x9000 image"):
        backend.preprocess(png_header_only(9000, 9000))  # no pixel data: a decode would fail otherwise
    with pytest.raises(LimitExceeded, match="encoded image size in bytes"):
        small = make_backend(name, backend.cfg, ImageLimits(1000, 1 << 26), "cpu")
        small.preprocess((DATA / "rocket.jpg").read_bytes())
    with pytest.raises(LimitExceeded, match="aspect ratio"):
        backend.preprocess(encode(rgb_image(1, 201), "PNG"))


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_is_a_decode_error(kind):
    backend = make_backend("torchvision", PreprocessConfig.default_for(QWEN2_5), LIMITS, "cpu")
    with pytest.raises(ImageDecodeError) as raised:
        backend.preprocess(BAD_INPUTS[kind]())
    assert not isinstance(raised.value, LimitExceeded)


# ---- the nvJPEG path, with a stand-in for torchvision.io.decode_jpeg ----


class StandInDecodeJpeg:
    """Called like torchvision.io.decode_jpeg; decodes with Pillow (so results are comparable), or fails."""

    def __init__(self, outcome: str = "decode"):
        self.outcome, self.calls = outcome, 0

    def __call__(self, encoded: torch.Tensor, *, mode, device) -> torch.Tensor:
        self.calls += 1
        assert encoded.dtype == torch.uint8 and encoded.dim() == 1 and mode == "RGB"
        if self.outcome == "error":
            raise RuntimeError("Error while decoding JPEG images")
        image = Image.open(io.BytesIO(encoded.numpy().tobytes())).convert("RGB")
        chw = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous().to(device)
        return chw[:, :-1] if self.outcome == "wrong_size" else chw


def nvjpeg_backend(outcome: str = "decode", limits: ImageLimits = LIMITS):
    stand_in = StandInDecodeJpeg(outcome)
    decoder = NvJpegDecoder(torch.device("cpu"), stand_in, "RGB")
    return TorchvisionBackend(PreprocessConfig.default_for(QWEN2_5), limits, "cpu", jpeg_decoder=decoder), stand_in


def test_nvjpeg_gets_rgb_and_grayscale_jpegs_only():
    backend, stand_in = nvjpeg_backend()
    plain = make_backend("torchvision", backend.cfg, LIMITS, "cpu")
    for make in JPEGS.values():
        data = make()
        assert torch.equal(backend.preprocess(data).pixel_values, plain.preprocess(data).pixel_values)
    assert stand_in.calls == len(JPEGS)
    for data in (cmyk_jpeg(), multi_picture_jpeg(), IMAGES["grayscale_l_png"](), IMAGES["webp_lossy"]()):
        backend.preprocess(data)
    assert stand_in.calls == len(JPEGS)  # CMYK, MPO and other formats: Pillow
    assert probe(multi_picture_jpeg(), LIMITS).format == "MPO"
    assert backend.fingerprint == "torchvision:resize=uint8,decode=nvjpeg" != plain.fingerprint


@pytest.mark.parametrize("exif_orientation", [True, False])
def test_nvjpeg_turns_a_rotated_jpeg_as_pillow_does(exif_orientation):
    """nvJPEG decodes the pixels as stored; the header's EXIF orientation is applied on the device (`upright`):
    the same pixels as Pillow's path for every orientation, and none with the setting off."""
    stand_in = StandInDecodeJpeg("decode")
    decoder = NvJpegDecoder(torch.device("cpu"), stand_in, "RGB")
    cfg = PreprocessConfig.default_for(QWEN2_5)
    backend = TorchvisionBackend(cfg, LIMITS, "cpu", jpeg_decoder=decoder, exif_orientation=exif_orientation)
    plain = make_backend("torchvision", cfg, LIMITS, "cpu", exif_orientation=exif_orientation)
    for orientation in range(1, 9):
        data = exif_jpeg(orientation)
        (header, ours), (_, pillows) = backend.decode(data), plain.decode(data)
        assert torch.equal(ours, pillows) and ours.is_contiguous(), orientation
        assert header.orientation == (orientation if exif_orientation else 1)
    assert stand_in.calls == 8


def test_upright_is_pillows_transpose():
    from encoder_service.preprocessing.decode import _UPRIGHT
    from encoder_service.preprocessing.nvjpeg import upright

    image = rgb_image(5, 7)
    chw = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    for orientation in range(1, 9):
        expect = image.transpose(_UPRIGHT[orientation]) if orientation in _UPRIGHT else image
        assert torch.equal(upright(chw, orientation).permute(1, 2, 0), torch.from_numpy(np.array(expect)))


@pytest.mark.parametrize("outcome", ["error", "wrong_size"])
def test_nvjpeg_failures_fall_back_to_pillow(outcome):
    backend, stand_in = nvjpeg_backend(outcome)
    plain = make_backend("torchvision", backend.cfg, LIMITS, "cpu")
    data = JPEGS["rocket"]()
    assert torch.equal(backend.preprocess(data).pixel_values, plain.preprocess(data).pixel_values)
    assert stand_in.calls == 1


def test_nvjpeg_path_checks_limits_before_decoding():
    backend, stand_in = nvjpeg_backend(limits=ImageLimits(max_image_bytes=32 << 20, max_pixels=1000))
    with pytest.raises(LimitExceeded, match="decoded pixel count"):
        backend.preprocess(JPEGS["rocket"]())
    with pytest.raises(ImageDecodeError):
        backend.preprocess(BAD_INPUTS["random_bytes"]())
    assert stand_in.calls == 0


def test_nvjpeg_without_torchvision_decodes_with_pillow(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if absent (the main venv has none anyway)
    with caplog.at_level(logging.WARNING):
        assert NvJpegDecoder.load(torch.device("cuda", 0)) is None
    assert "JPEGs are decoded by Pillow" in caplog.text


# ---- choosing a backend: settings, fingerprint, the core ----


def test_make_backend_knows_every_setting(caplog):
    cfg = PreprocessConfig.default_for(QWEN2_5)
    with caplog.at_level(logging.WARNING):
        prints = {name: make_backend(name, cfg, LIMITS, "cpu").fingerprint for name in PREPROCESS_BACKENDS}
    assert prints == {"pil": "pil", "torchvision": "torchvision:resize=uint8,decode=pil",
                      "torchvision-nvjpeg": "torchvision:resize=uint8,decode=pil"}  # no nvJPEG on the CPU
    assert "nvJPEG decodes on CUDA only; the model is on cpu" in caplog.text  # said, for the opt-in only
    with pytest.raises(ValueError, match="expected one of pil, torchvision"):
        make_backend("opencv", cfg, LIMITS, "cpu")


def test_on_cuda_only_the_opt_in_decodes_with_nvjpeg(monkeypatch):
    """The default `torchvision` is the exact path on CUDA too (Pillow decodes); nvJPEG, not bit-exact with
    Pillow, only for `torchvision-nvjpeg`. Built for cuda:0 without touching CUDA; the decoder a stand-in."""
    loads = []

    def load(device):
        loads.append(device)
        return NvJpegDecoder(device, StandInDecodeJpeg(), "RGB")

    monkeypatch.setattr(NvJpegDecoder, "load", staticmethod(load))
    cfg = PreprocessConfig.default_for(QWEN2_5)
    assert make_backend("torchvision", cfg, LIMITS, "cuda:0").fingerprint == "torchvision:resize=float32,decode=pil"
    assert loads == []
    nvjpeg = make_backend("torchvision-nvjpeg", cfg, LIMITS, "cuda:0")
    assert nvjpeg.fingerprint == "torchvision:resize=float32,decode=nvjpeg" and loads == [torch.device("cuda", 0)]


def test_preprocess_setting_defaults_to_the_device(monkeypatch, caplog):
    def preprocess(*args, env=None):
        return Settings.from_args(["--model", "m", *args], env=env or {}).model.preprocess

    assert preprocess("--device", "cuda") == "torchvision"
    assert preprocess("--device", "cuda:1") == "torchvision"
    assert preprocess("--device", "cpu") == "pil"
    monkeypatch.setattr("encoder_service.settings._cuda_available", lambda: True)
    assert preprocess() == "torchvision"
    monkeypatch.setattr("encoder_service.settings._cuda_available", lambda: False)
    assert preprocess() == "pil"
    assert preprocess("--device", "cpu", "--preprocess", "torchvision") == "torchvision"
    assert preprocess("--device", "cuda", env={"ENCODER_PREPROCESS": "torchvision-nvjpeg"}) == "torchvision-nvjpeg"
    assert preprocess("--preprocess", "pil", env={"ENCODER_PREPROCESS": "torchvision"}) == "pil"
    with pytest.raises(SettingsError, match="--preprocess / ENCODER_PREPROCESS .*must be one of pil, torchvision, "
                                            "torchvision-nvjpeg, got 'nvjpeg'"):
        preprocess("--preprocess", "nvjpeg")
    # The exact path's old name: what `torchvision` is now, with a warning, for one release.
    assert PREPROCESS_ALIASES == {"torchvision-pil-decode": "torchvision"}
    for args, env in [(("--preprocess", "torchvision-pil-decode"), None),
                      ((), {"ENCODER_PREPROCESS": "torchvision-pil-decode"})]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="encoder_service.settings"):
            assert preprocess("--device", "cuda", *args, env=env) == "torchvision"
        assert "torchvision-pil-decode is deprecated" in caplog.text and "use torchvision" in caplog.text


def test_fingerprint_names_the_backend():
    pre = PreprocessConfig.default_for(QWEN2_5)
    base = model_fingerprint("ckpt", "qwen2_5_vl", "bfloat16", pre, layout="main")
    prints = {model_fingerprint("ckpt", "qwen2_5_vl", "bfloat16", pre, layout="main", preprocess_backend=b)
              for b in ("pil", "torchvision:resize=uint8,decode=pil", "torchvision:resize=float32,decode=pil",
                        "torchvision:resize=float32,decode=nvjpeg")}
    assert len(prints) == 4
    assert base in prints  # pil: the fingerprint from before there were backends, unchanged
    # The EXIF orientation applied (the default) is another namespace; ignored, the fingerprint of before.
    upright = model_fingerprint("ckpt", "qwen2_5_vl", "bfloat16", pre, layout="main", exif_orientation=True)
    assert upright not in prints
    assert model_fingerprint("ckpt", "qwen2_5_vl", "bfloat16", pre, layout="main", exif_orientation=False) == base


@pytest.mark.timeout(120)
async def test_core_turns_a_rotated_photo_upright_unless_told_not_to(tiny_checkpoint):
    """A photo stored landscape with EXIF Orientation 6 is encoded portrait, as the engines see it: the grid
    from the header, the rows of the upright image; --no-exif-orientation keeps the pixels as stored, under
    another fingerprint (rows of one setting never serve the other). The id stays the hash of the bytes."""
    from PIL import ImageOps

    checkpoint = tiny_checkpoint("qwen2_5_vl")
    photo = Image.open(DATA / "rocket.jpg").crop((208, 110, 432, 278))  # the rocket, 224x168
    data = encode(photo, "JPEG", quality=95, exif=orientation_exif(6))
    upright = encode(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), "PNG")  # the same pixels, upright
    as_stored = encode(Image.open(io.BytesIO(data)).convert("RGB"), "PNG")  # the same pixels, no EXIF
    cores = {flag: build_core(make_settings(checkpoint, flag, grpc=False))
             for flag in ("--exif-orientation", "--no-exif-orientation")}
    try:
        results = {}
        for flag, core in cores.items():
            await core.start()
            results[flag] = await core.encode([ImageInput(data=data)], return_embeddings=True)
        on, off = cores["--exif-orientation"], cores["--no-exif-orientation"]
        assert on.metadata()["exif_orientation"] is True and off.metadata()["exif_orientation"] is False
        assert on.model_fp != off.model_fp and on.video_fp != off.video_fp
        (turned,), (stored,) = results["--exif-orientation"].images, results["--no-exif-orientation"].images
        assert turned.id == stored.id  # the content hash of the bytes
        assert turned.grid_thw == (1, 16, 12) and stored.grid_thw == (1, 12, 16)
        assert_close(results["--exif-orientation"].embeddings[0], reference_rows(checkpoint, upright))
        assert_close(results["--no-exif-orientation"].embeddings[0], reference_rows(checkpoint, as_stored))
    finally:
        for core in cores.values():
            await core.stop()


@pytest.mark.timeout(120)
async def test_core_serves_with_the_torchvision_backend(tiny_checkpoint):
    checkpoint = tiny_checkpoint("qwen2_5_vl")
    cores = [build_core(make_settings(checkpoint, "--preprocess", name, grpc=False)) for name in ("pil", "torchvision")]
    data = JPEGS["rocket"]()
    try:
        results = []
        for core in cores:
            await core.start()
            results.append(await core.encode([ImageInput(data=data)], return_embeddings=True))
        pil, tv = cores
        assert pil.metadata()["preprocess"] == "pil"
        assert tv.metadata()["preprocess"] == "torchvision:resize=uint8,decode=pil"
        assert pil.model_fp != tv.model_fp
        assert results[0].images[0].id == results[1].images[0].id  # the content hash; the key's namespace differs
        assert results[0].images[0].grid_thw == results[1].images[0].grid_thw
        for result, name in zip(results, ("pil", "torchvision")):
            assert_close(result.embeddings[0], reference_rows(checkpoint, data, name))
        assert not torch.equal(reference_rows(checkpoint, data, "pil"), reference_rows(checkpoint, data, "torchvision"))
    finally:
        for core in cores:
            await core.stop()
