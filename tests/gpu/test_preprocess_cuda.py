"""The torchvision preprocessing backend on CUDA (preprocessing/backends.py, torch_ops.py, nvjpeg.py).

1. Equal to transformers' `Qwen2VLImageProcessor` run with device="cuda": the default `torchvision` given the
   PIL image itself (it decodes with Pillow, as transformers does), `torchvision-nvjpeg` given the same
   decoded uint8 pixels (nvJPEG's: transformers never decodes on the GPU). Bit for bit: the same torch ops on
   the same device.
2. nvJPEG against Pillow's libjpeg-turbo: not bit-exact (another IDCT and chroma upsampling); within the
   bound torchvision's own tests use, mean |difference| < 2 levels, on these photos.
3. The device tensors both backends hand over work in both runners as the host ones do, from many threads
   at once.
Time per image: benchmarks/preprocess_decode.py.

Needs torchvision (nvJPEG, and transformers' processor imports it):
    python -m pytest -q tests/gpu/test_preprocess_cuda.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision", reason="nvJPEG and transformers' torchvision processor need torchvision")

from transformers import Qwen2VLImageProcessor

from encoder_service.preprocessing import PreprocessConfig, make_backend, probe
from encoder_service.preprocessing.decode import decode_rgb
from encoder_service.preprocessing.nvjpeg import NvJpegDecoder
from encoder_service.runtime.runner import make_runner
from tests.support.preprocess_cases import (
    CASES,
    HUB_CONFIGS,
    JPEGS,
    LIMITS,
    cmyk_jpeg,
    encode,
    family_fixture,
    loaded,
    multi_picture_jpeg,
    rgb_image,
)


family = family_fixture(Qwen2VLImageProcessor)  # (our config, transformers' processor) per published checkpoint


def assert_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.device.type == theirs.device.type == "cuda" and ours.dtype == theirs.dtype == torch.float32
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs()
    assert torch.equal(ours, theirs), f"max |diff| {diff.max().item()}, {(diff > 0).float().mean().item():.2%} differ"


@pytest.mark.parametrize("name", sorted(CASES))
def test_equal_to_transformers_on_cuda(name, family):
    cfg, processor = family
    data = CASES[name]()
    exact = make_backend("torchvision", cfg, LIMITS, "cuda")  # the default on CUDA
    assert exact.fingerprint == "torchvision:resize=float32,decode=pil"
    reference = processor(loaded(data), return_tensors="pt", device="cuda")  # upright, as the engines load it
    ours = exact.preprocess(data)
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0].tolist())
    assert_equal(ours.pixel_values, reference["pixel_values"])

    nvjpeg = make_backend("torchvision-nvjpeg", cfg, LIMITS, "cuda")
    assert nvjpeg.fingerprint == "torchvision:resize=float32,decode=nvjpeg"
    _, pixels = nvjpeg.decode(data)  # [3, H, W] uint8 on the GPU: nvJPEG's for most JPEGs, else Pillow's
    reference = processor(pixels, input_data_format="channels_first", return_tensors="pt", device="cuda")
    assert_equal(nvjpeg.preprocess(data).pixel_values, reference["pixel_values"])  # decodes again: deterministic


PHOTOS = ("grace_hopper", "rocket", "photo_1080p")


@pytest.mark.parametrize("name", sorted(JPEGS))
def test_nvjpeg_is_close_to_pillow(name, capsys):
    data = JPEGS[name]()
    decoder = NvJpegDecoder.load(torch.device("cuda", torch.cuda.current_device()))
    assert decoder is not None
    header = probe(data, LIMITS)
    assert decoder.accepts(header)
    gpu = decoder.decode(data, header)
    assert gpu is not None, "nvJPEG refused it: the backend would decode it with Pillow"
    pil = torch.from_numpy(np.array(decode_rgb(data, LIMITS)[1])).permute(2, 0, 1)
    diff = (gpu.cpu().int() - pil.int()).abs()
    with capsys.disabled():
        print(f"\nnvJPEG vs Pillow {name} {header.width}x{header.height}: mean |diff| {diff.float().mean():.3f}, "
              f"max {diff.max()}, {(diff > 0).float().mean():.1%} of values differ")
    # torchvision's test_decode_jpeg_cuda bound (mean < 2) is for photographs; nvJPEG upsamples subsampled chroma
    # otherwise than libjpeg-turbo, which shows most on synthetic textures of hard edges (H100, 2026-11-23: 5.3 to
    # 7.5 for exif_rotated, progressive, subsampling_420 / 422). A wrong decode (shifted, channels swapped,
    # another orientation) of these textures is around 60.
    assert diff.float().mean() < (2 if name in PHOTOS else 12)


@pytest.mark.parametrize("size", [(1920, 1080), (4096, 2304)])  # pinned / over PINNED_PIXELS_MAX_BYTES: pageable
def test_the_direct_jpeg_decode_uploads_pillow_s_pixels_pinned_or_not(size, monkeypatch):
    """The exact backend's JPEG path on CUDA (jpeg_into.py into host memory of ours, pinned up to 32 MiB of
    RGBX) hands over Pillow's pixels, from many threads at once; and with the direct decode turned off (a
    Pillow whose self-check failed) the usual path gives the same."""
    from encoder_service.preprocessing import backends, jpeg_into

    assert (size[0] * size[1] * 4 <= backends.PINNED_PIXELS_MAX_BYTES) == (size == (1920, 1080))
    datas = [encode(rgb_image(size[1], size[0], seed), "JPEG", quality=90) for seed in range(6)]
    expected = [torch.from_numpy(np.array(decode_rgb(d, LIMITS)[1])).permute(2, 0, 1) for d in datas]
    backend = make_backend("torchvision", PreprocessConfig.default_for(HUB_CONFIGS["qwen2_5"][0]), LIMITS, "cuda")
    streams = backends.ThreadStreams(backend.device)
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda d: streams.run(lambda: backend.decode(d)[1], lambda t: t), datas * 2))
    assert all(torch.equal(g.cpu(), e) for g, e in zip(got, expected * 2))
    monkeypatch.setattr(jpeg_into, "usable", lambda: False)
    assert torch.equal(backend.decode(datas[0])[1].cpu(), expected[0])


def test_nvjpeg_leaves_cmyk_and_multi_picture_to_pillow():
    decoder = NvJpegDecoder.load(torch.device("cuda", torch.cuda.current_device()))
    assert not decoder.accepts(probe(cmyk_jpeg(), LIMITS))
    assert not decoder.accepts(probe(multi_picture_jpeg(), LIMITS))


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("name", ["torchvision", "torchvision-nvjpeg"])
def test_runners_take_the_device_tensors_from_many_threads(loaded, cuda_graphs, name):
    """The engine's path: prepare on pool threads (one stream each), the GPU thread encodes on the default
    stream. Rows equal those of the same values handed over from pinned host memory."""
    lm = loaded("qwen2_5_vl", "cuda", torch.bfloat16)
    cfg = PreprocessConfig.from_checkpoint(lm.checkpoint_dir, lm.spec)
    backend = make_backend(name, cfg, LIMITS, "cuda")
    runner = make_runner(lm, cuda_graphs=cuda_graphs, buckets=[64, 256])
    datas = [make() for make in JPEGS.values()] * 3
    with ThreadPoolExecutor(max_workers=8) as pool:
        prepared = list(pool.map(lambda d: backend.preprocess(d, torch.bfloat16), datas))
    alone = [backend.preprocess(d, torch.bfloat16) for d in datas]
    assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(alone, prepared))
    assert all(p.pixel_values.device.type == "cuda" and p.pixel_values.dtype == torch.bfloat16 for p in prepared)
    assert all(torch.equal(p.pixel_values, backend.preprocess(d).pixel_values.to(torch.bfloat16))
               for p, d in zip(prepared, datas))
    for start in range(0, len(prepared), 4):
        batch = prepared[start : start + 4]
        grids = [p.grid_thw for p in batch]
        on_device = runner.encode([p.pixel_values for p in batch], grids)
        on_host = runner.encode([p.pixel_values.cpu().pin_memory() for p in batch], grids)
        assert all(torch.equal(a, b) for a, b in zip(on_device, on_host))
