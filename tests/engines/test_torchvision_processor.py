"""The torchvision backend on the CPU equals transformers' default Qwen-VL processor, `Qwen2VLImageProcessor`
(torchvision), run with device="cpu" on the same PIL image: bit for bit (torch.equal).

The torchvision tier: run in its own venv by scripts/tiers/torchvision.sh (from scripts/test.sh, after the main
suite); skipped in the main venv, which cannot hold torchvision beside its CPU torch.

On CUDA the comparison is tests/gpu/test_preprocess_cuda.py: torchvision resizes differently there, so a
CPU result is never compared with a CUDA one.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.engine_tier import require

require("torchvision", "scripts/tiers/torchvision.sh")

from transformers import AutoImageProcessor, Qwen2VLImageProcessor  # noqa: E402 - needs torchvision

from encoder_service.preprocessing import make_backend  # noqa: E402
from tests.support.preprocess_cases import (  # noqa: E402
    CASES,
    DATA,
    HUB_CONFIGS,
    LIMITS,
    PHOTOS,
    QWEN2_5,
    SMALL_SETTINGS,
    config_and_processor,
    encode,
    loaded,
    rgb_image,
    write_checkpoint,
)


def load(path, spec, settings):
    """(our torchvision backend on the CPU, transformers' processor) from the same checkpoint directory."""
    cfg, processor = config_and_processor(path, spec, settings, Qwen2VLImageProcessor)
    return make_backend("torchvision", cfg, LIMITS, "cpu"), processor


@pytest.fixture(params=sorted(HUB_CONFIGS), scope="module")
def family(request, tmp_path_factory):
    spec, settings = HUB_CONFIGS[request.param]
    return load(tmp_path_factory.mktemp(request.param), spec, settings)


def assert_same_as_transformers(data: bytes, family) -> None:
    backend, processor = family
    reference = processor(loaded(data), return_tensors="pt", device="cpu")  # upright, as the engines load it
    ours = backend.preprocess(data)
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == reference["pixel_values"].dtype == torch.float32
    assert ours.pixel_values.shape == reference["pixel_values"].shape
    max_diff = (ours.pixel_values - reference["pixel_values"]).abs().max().item()
    assert torch.equal(ours.pixel_values, reference["pixel_values"]), f"max abs diff {max_diff}"


def test_the_default_processor_is_the_one_compared(tmp_path):
    """AutoImageProcessor picks Qwen2VLImageProcessor (torchvision) for these checkpoints."""
    for name, (_, settings) in HUB_CONFIGS.items():
        processor = AutoImageProcessor.from_pretrained(write_checkpoint(tmp_path / name, settings))
        assert type(processor) is Qwen2VLImageProcessor


@pytest.mark.parametrize("name", sorted(CASES))
def test_images(name, family):
    assert_same_as_transformers(CASES[name](), family)


def test_sizes_needing_no_resize(family):
    backend, _ = family
    factor = backend.cfg.factor
    for height, width in ((factor * 10, factor * 14), (factor * 3, factor * 40)):
        data = encode(rgb_image(height, width), "PNG")
        patch = backend.cfg.patch_size
        assert backend.preprocess(data).grid_thw[1:] == (height // patch, width // patch)
        assert_same_as_transformers(data, family)


def test_large_downscale(tmp_path):
    family = load(tmp_path, QWEN2_5, SMALL_SETTINGS)
    for name in PHOTOS:
        assert_same_as_transformers((DATA / name).read_bytes(), family)
