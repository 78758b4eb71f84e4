"""The direct JPEG decode (preprocessing/jpeg_into.py): Pillow's pixels, bit for bit, written into memory of
ours; what it does not take, or fails on, goes the usual way with the usual errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_service.errors import ImageDecodeError
from encoder_service.preprocessing import PreprocessConfig, jpeg_into, make_backend
from encoder_service.preprocessing.decode import decode_rgb, open_image
from tests.support.preprocess_cases import (
    BAD_INPUTS,
    CASES,
    HUB_CONFIGS,
    JPEGS,
    LIMITS,
    encode,
    multi_picture_jpeg,
    rgb_image,
)

# Beside the JPEG kinds of the shared cases: what else changes how libjpeg walks the file.
MORE_JPEGS = {
    "restart_markers": lambda: encode(rgb_image(211, 333, 8), "JPEG", quality=88, restart_marker_blocks=3),
    "restart_marker_rows": lambda: encode(rgb_image(97, 131, 9), "JPEG", restart_marker_rows=1),
    "optimized_huffman": lambda: encode(rgb_image(150, 250, 10), "JPEG", optimize=True),
    "subsampling_411": lambda: encode(rgb_image(77, 203, 11), "JPEG", subsampling="4:1:1"),
    "one_pixel": lambda: encode(rgb_image(1, 1, 12), "JPEG"),
    "multi_picture": multi_picture_jpeg,
    "rgb_kept_as_rgb": lambda: encode(rgb_image(64, 48, 13), "JPEG", keep_rgb=True),  # Adobe: no YCbCr
}
ALL_JPEGS = {**JPEGS, **MORE_JPEGS}


def direct(data: bytes) -> np.ndarray | None:
    """[H, W, 3] as decoded straight into our array, or None where the direct decode does not take it."""
    header, image = open_image(data, LIMITS)
    if not jpeg_into.takes(image, header.orientation):
        return None
    out = np.full((image.height, image.width, 4), 7, np.uint8)
    assert jpeg_into.decode_into(image, data, out)
    return out[..., :3]


def tv_backend():
    return make_backend("torchvision", PreprocessConfig.default_for(HUB_CONFIGS["qwen2_5"][0]), LIMITS, "cpu")


def test_this_pillow_passes_the_self_check():
    assert jpeg_into.usable()


@pytest.mark.parametrize("name", sorted(ALL_JPEGS))
def test_an_upright_rgb_jpeg_decodes_to_pillow_s_pixels(name):
    data = ALL_JPEGS[name]()
    expected = np.asarray(decode_rgb(data, LIMITS)[1])
    header, image = open_image(data, LIMITS)
    taken = image.mode == "RGB" and header.orientation == 1
    assert jpeg_into.takes(image, header.orientation) == taken
    if taken:
        assert np.array_equal(direct(data), expected)


@pytest.mark.parametrize("name", sorted(set(CASES) - {f"jpeg_{n}" for n in JPEGS}))
def test_nothing_but_upright_rgb_jpegs_is_taken(name):
    data = CASES[name]()
    header, image = open_image(data, LIMITS)
    assert jpeg_into.takes(image, header.orientation) == (
        image.format in ("JPEG", "MPO") and image.mode == "RGB" and header.orientation == 1)


@pytest.mark.parametrize("kept", [0.3, 0.7, 0.999])
def test_a_truncated_jpeg_is_refused_and_the_usual_decode_names_it(kept):
    whole = JPEGS["rocket"]()
    data = whole[:int(len(whole) * kept)]
    header, image = open_image(data, LIMITS)
    assert jpeg_into.takes(image, header.orientation)
    out = np.zeros((image.height, image.width, 4), np.uint8)
    assert not jpeg_into.decode_into(image, data, out)
    with pytest.raises(ImageDecodeError, match="truncated|broken|cannot decode"):
        tv_backend().decode(data)


def test_corrupt_entropy_data_fails_the_same_way_on_both_paths():
    data = bytearray(JPEGS["subsampling_420"]())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff\xd9" * 32  # an end-of-image marker inside the scan
    for source in (bytes(data), BAD_INPUTS["truncated_jpeg"]()):
        try:
            expected = np.array(decode_rgb(source, LIMITS)[1])
        except ImageDecodeError:
            expected = None
        header, image = open_image(source, LIMITS)
        out = np.zeros((image.height, image.width, 4), np.uint8)
        if jpeg_into.decode_into(image, source, out):  # the direct path took it: Pillow's own decode did too
            assert expected is not None and np.array_equal(out[..., :3], expected)
        if expected is None:
            with pytest.raises(ImageDecodeError):
                tv_backend().decode(source)
        else:
            assert torch.equal(tv_backend().decode(source)[1], torch.from_numpy(expected).permute(2, 0, 1))


def test_out_of_the_wrong_shape_is_a_programming_error():
    data = JPEGS["rocket"]()
    _, image = open_image(data, LIMITS)
    with pytest.raises(ValueError, match="out must be"):
        jpeg_into.decode_into(image, data, np.zeros((image.height, image.width, 3), np.uint8))


@pytest.mark.parametrize("name", sorted(ALL_JPEGS))
def test_the_torchvision_backend_uploads_the_same_pixels_either_way(name):
    data = ALL_JPEGS[name]()
    _, chw = tv_backend().decode(data)
    expected = torch.from_numpy(np.array(decode_rgb(data, LIMITS)[1])).permute(2, 0, 1)
    assert chw.is_contiguous() and chw.dtype == torch.uint8 and torch.equal(chw, expected)


def test_a_pillow_whose_direct_decode_differs_is_not_used(monkeypatch, caplog):
    jpeg_into.usable.cache_clear()
    real = jpeg_into.decode_into

    def off_by_one(image, data, out):
        ok = real(image, data, out)
        out[0, 0, 0] ^= 1
        return ok

    monkeypatch.setattr(jpeg_into, "decode_into", off_by_one)
    try:
        assert not jpeg_into.usable()
        with Image.open(io.BytesIO(JPEGS["rocket"]())) as image:
            assert not jpeg_into.takes(image, 1)
        assert "differs" in caplog.text
    finally:
        jpeg_into.usable.cache_clear()
