"""Preprocessing: equal to transformers' Qwen2VLImageProcessorPil, and safe on hostile input."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from PIL import Image, ImageFile
from transformers import Qwen2VLImageProcessorPil

from encoder_service.errors import ImageDecodeError, LimitExceeded, ModelLoadError
from encoder_service.preprocessing import (
    ImageHeader,
    ImageLimits,
    PreprocessConfig,
    plan,
    preprocess,
    probe,
)
from tests.support.images import png_header_only
from tests.support.preprocess_cases import (
    BAD_INPUTS,
    CLIP_MEAN,
    DATA,
    IMAGES,
    LIMITS,
    ODD_SIZES,
    ORIENTED,
    PHOTOS,
    QWEN2_5,
    QWEN3,
    SMALL_SETTINGS,
    animated_gif,
    config_and_processor,
    encode,
    exif_jpeg,
    exif_rotated_jpeg,
    family_fixture,
    loaded,
    multi_picture_jpeg,
    photo_1080p_jpeg,
    png_exif_after_pixels,
    rgb_image,
    write_checkpoint,
)


family = family_fixture(Qwen2VLImageProcessorPil)  # (our config, transformers' processor) per published checkpoint


def assert_same_as_transformers(data: bytes, family, exif_orientation: bool = True) -> None:
    """Ours on the bytes == transformers' processor on the image as the engines load it (upright by its EXIF
    orientation, unless `exif_orientation` is False)."""
    cfg, reference_processor = family
    reference = reference_processor(loaded(data, exif_orientation), return_tensors="pt")
    ours = preprocess(data, cfg, LIMITS, exif_orientation=exif_orientation)
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == reference["pixel_values"].shape
    # Exact: the same Pillow calls and the same float32 arithmetic (see patchify.py).
    max_diff = (ours.pixel_values - reference["pixel_values"]).abs().max().item()
    assert torch.equal(ours.pixel_values, reference["pixel_values"]), f"max abs diff {max_diff}"
    # What encode answers from the header alone agrees with what the tower gets.
    image_plan = plan(probe(data, LIMITS, exif_orientation=exif_orientation), cfg)
    assert (image_plan.grid_thw, image_plan.num_tokens) == (ours.grid_thw, ours.num_tokens)
    assert ours.num_tokens == ours.pixel_values.shape[0] // cfg.merge_size**2


# ---- parity with transformers ----


@pytest.mark.parametrize("name", PHOTOS)
def test_real_photographs_match_transformers(name, family):
    assert_same_as_transformers((DATA / name).read_bytes(), family)


def test_1080p_jpeg_matches_transformers(family):
    assert_same_as_transformers(photo_1080p_jpeg(), family)


@pytest.mark.parametrize("height, width", ODD_SIZES)
def test_sizes_match_transformers(height, width, family):
    assert_same_as_transformers(encode(rgb_image(height, width), "PNG"), family)


def test_large_downscale_matches_transformers(tmp_path):
    """max_pixels far below the photo's size (like the tiny test checkpoints): a 5x bicubic reduction."""
    family = config_and_processor(tmp_path, QWEN2_5, SMALL_SETTINGS, Qwen2VLImageProcessorPil)
    for name in PHOTOS:
        assert_same_as_transformers((DATA / name).read_bytes(), family)


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_modes_and_formats_match_transformers(kind, family):
    assert_same_as_transformers(IMAGES[kind](), family)


def test_modes_under_test_are_the_ones_named():
    """Guards the cases above against Pillow saving or opening them in some other mode."""
    modes = {kind: Image.open(io.BytesIO(make())).mode for kind, make in IMAGES.items()}
    assert modes["rgba_png"] == "RGBA" and modes["la_png"] == "LA" and modes["palette_png"] == "P"
    assert modes["16bit_png"] == "I;16" and modes["cmyk_jpeg"] == "CMYK" and modes["bilevel_1_png"] == "1"
    assert modes["int32_i_tiff"] == "I" and modes["float_f_tiff"] == "F" and modes["grayscale_l_png"] == "L"
    assert "transparency" in Image.open(io.BytesIO(IMAGES["palette_png_transparent_index"]())).info
    assert Image.open(io.BytesIO(animated_gif())).n_frames == 3
    assert probe(multi_picture_jpeg(), LIMITS).format == "MPO"


@pytest.mark.parametrize("kind", sorted(ORIENTED))
def test_exif_orientation_off_is_the_pixels_as_stored(kind, family):
    """--no-exif-orientation: what the service did before it applied the orientation (transformers' processor
    given the decoded image as it is)."""
    assert_same_as_transformers(ORIENTED[kind](), family, exif_orientation=False)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_probe_sizes_a_rotated_photo_upright_from_its_header(orientation):
    """Orientations 5-8 swap width and height: read from the EXIF alone (a truncated file still probes)."""
    data = exif_jpeg(orientation)
    upright = (60, 90) if orientation >= 5 else (90, 60)
    for sent in (data, data[: len(data) // 3]):
        header = probe(sent, LIMITS)
        assert (header.width, header.height, header.orientation) == (*upright, orientation)
        assert header.stored_size == (90, 60)
    off = probe(data, LIMITS, exif_orientation=False)
    assert (off.width, off.height, off.orientation) == (90, 60, 1)
    assert plan(probe(exif_rotated_jpeg(), LIMITS), PreprocessConfig.default_for(QWEN2_5)).grid_thw == (1, 6, 4)


def test_orientation_after_the_pixels_of_a_png_is_found():
    """A PNG's eXIf after its image data: Pillow reads it only with the pixels, and so does probe (exif_transpose
    turns it); before it, the header is enough."""
    from encoder_service.preprocessing.decode import _png_metadata_after_pixels

    after, before = png_exif_after_pixels(6), ORIENTED["exif_png_rgba"]()
    assert _png_metadata_after_pixels(after) and not _png_metadata_after_pixels(before)
    assert (probe(after, LIMITS).width, probe(after, LIMITS).height) == loaded(after).size == (60, 90)


def test_an_unreadable_exif_is_no_orientation():
    """An EXIF Pillow cannot read (its byte order broken): the image as stored, no error, as exif_transpose
    and vLLM's loader leave it."""
    data = ORIENTED["exif_broken"]()
    assert probe(data, LIMITS) == ImageHeader(width=90, height=60, format="JPEG", mode="RGB", orientation=1)
    assert loaded(data).size == (90, 60)


def test_concurrent_calls_agree():
    """The service runs preprocess on a thread pool: calls must not share state."""
    cfg = PreprocessConfig.default_for(QWEN2_5)
    inputs = [(DATA / name).read_bytes() for name in PHOTOS] * 3
    alone = [preprocess(data, cfg, LIMITS).pixel_values for data in inputs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda data: preprocess(data, cfg, LIMITS).pixel_values, inputs))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


# ---- header-only sizing ----


def test_probe_reads_only_the_header():
    photo = (DATA / "rocket.jpg").read_bytes()
    truncated = photo[: len(photo) // 3]
    assert probe(truncated, LIMITS) == ImageHeader(width=640, height=427, format="JPEG", mode="RGB")
    with pytest.raises(ImageDecodeError, match="truncated"):
        preprocess(truncated, PreprocessConfig.default_for(QWEN2_5), LIMITS)


def test_plan_of_1080p():
    header = ImageHeader(1920, 1080, "JPEG", "RGB")
    qwen2_5 = plan(header, PreprocessConfig.default_for(QWEN2_5))
    assert (qwen2_5.resized_height, qwen2_5.resized_width, qwen2_5.grid_thw) == (1092, 1932, (1, 78, 138))
    assert qwen2_5.num_tokens == 2691  # 39 x 69 merged tokens
    qwen3 = plan(header, PreprocessConfig.default_for(QWEN3))
    assert (qwen3.grid_thw, qwen3.num_tokens) == ((1, 68, 120), 2040)


# ---- config ----


def test_config_forms_match_transformers(tmp_path):
    forms = {
        "top_level_pixels": {"min_pixels": 1000, "max_pixels": 200000},
        "size_dict": {"size": {"shortest_edge": 2000, "longest_edge": 300000}},
        "top_level_overrides_size": {"size": {"shortest_edge": 2000, "longest_edge": 300000}, "max_pixels": 90000},
        "silent_file": {},  # transformers' class defaults: 56*56 .. 28*28*1280, CLIP mean/std
        "null_pixels": {"min_pixels": None, "max_pixels": None},
        "scalar_mean_std": {"image_mean": 0.5, "image_std": 0.25, "rescale_factor": 0.5},
    }
    for name, settings in forms.items():
        checkpoint = write_checkpoint(tmp_path / name, settings)
        ours = PreprocessConfig.from_checkpoint(checkpoint, QWEN2_5)
        theirs = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
        mean, std = ([theirs.image_mean] * 3, [theirs.image_std] * 3) if name == "scalar_mean_std" else (
            theirs.image_mean, theirs.image_std)
        assert (ours.min_pixels, ours.max_pixels) == (theirs.size.shortest_edge, theirs.size.longest_edge), name
        assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == (
            theirs.patch_size, theirs.temporal_patch_size, theirs.merge_size), name
        assert (ours.image_mean, ours.image_std, ours.rescale_factor) == (
            tuple(mean), tuple(std), theirs.rescale_factor), name
    assert PreprocessConfig.from_checkpoint(tmp_path / "silent_file", QWEN2_5).max_pixels == 28 * 28 * 1280


def test_config_saved_by_transformers_round_trips(tmp_path):
    Qwen2VLImageProcessorPil(patch_size=16, min_pixels=4096, max_pixels=65536, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3).save_pretrained(tmp_path)
    cfg = PreprocessConfig.from_checkpoint(tmp_path, QWEN3)
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (16, 4096, 65536, (0.5, 0.5, 0.5))


def test_processor_config_takes_precedence(tmp_path):
    write_checkpoint(tmp_path, {"min_pixels": 1000, "max_pixels": 100000})
    write_checkpoint(tmp_path, {"image_processor": {"min_pixels": 2000, "max_pixels": 50000}}, "processor_config.json")
    cfg = PreprocessConfig.from_checkpoint(tmp_path, QWEN2_5)
    assert (cfg.min_pixels, cfg.max_pixels) == (2000, 50000)
    assert Qwen2VLImageProcessorPil.from_pretrained(tmp_path).size.longest_edge == 50000


def test_defaults_when_no_file(tmp_path):
    assert PreprocessConfig.from_checkpoint(tmp_path, QWEN3) == PreprocessConfig.default_for(QWEN3)
    qwen3, qwen2_5 = PreprocessConfig.default_for(QWEN3), PreprocessConfig.default_for(QWEN2_5)
    assert (qwen3.patch_size, qwen3.min_pixels, qwen3.max_pixels, qwen3.image_std) == (16, 65536, 16777216, (0.5,) * 3)
    assert (qwen2_5.patch_size, qwen2_5.min_pixels, qwen2_5.max_pixels) == (14, 3136, 12845056)
    assert qwen2_5.image_mean == tuple(CLIP_MEAN)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({}, "patch_size is 14 but the vision tower's is 16"),  # silent file: transformers' 14 vs Qwen3's 16
        ({"patch_size": 16, "merge_size": 3}, "merge_size is 3"),
        ({"patch_size": 16, "size": {"shortest_edge": 3136}}, "shortest_edge and longest_edge"),
        ({"patch_size": 16, "size": {"min_pixels": 1, "max_pixels": 2}}, "shortest_edge and longest_edge"),
        ({"patch_size": 16, "min_pixels": 5000, "max_pixels": 4000}, "min_pixels <= max_pixels"),
        ({"patch_size": 16, "do_normalize": False}, "do_normalize"),
        ({"patch_size": 16, "resample": 2}, "resample"),
        ({"patch_size": 16, "image_mean": [0.5, 0.5]}, "image_mean has 2 values"),
        ({"patch_size": 16, "rescale_factor": 0.003}, "rescale_factor 0.003"),
        ({"patch_size": 16, "image_std": [0.5, 0, 0.5]}, "has a zero"),
    ],
)
def test_config_rejects(settings, message, tmp_path):
    with pytest.raises(ModelLoadError, match=message):
        PreprocessConfig.from_checkpoint(write_checkpoint(tmp_path, settings), QWEN3)


def test_unreadable_config_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        PreprocessConfig.from_checkpoint(tmp_path, QWEN2_5)


# ---- limits and hostile input ----


def test_encoded_bytes_over_limit():
    data = (DATA / "rocket.jpg").read_bytes()
    with pytest.raises(LimitExceeded, match=f"encoded image size in bytes is {len(data)}, over the limit of 1000"):
        probe(data, ImageLimits(max_image_bytes=1000, max_pixels=1 << 26))


def test_decoded_pixels_over_limit_from_header():
    data = png_header_only(9000, 9000)  # 81M pixels: over our 64 Mi, under Pillow's own warning threshold
    assert len(data) < 200
    message = "decoded pixel count of the 9000x9000 image is 81000000, over the limit of 67108864"
    with pytest.raises(LimitExceeded, match=message) as raised:
        preprocess(data, PreprocessConfig.default_for(QWEN2_5), LIMITS)
    assert (raised.value.value, raised.value.limit) == (81000000, 67108864)


def test_decompression_bomb_is_our_limit_error():
    # 2.5G pixels: Pillow's own guard raises inside Image.open, before our check can run.
    with pytest.raises(LimitExceeded, match="decoded pixel count is 2500000000, over the limit of 67108864"):
        probe(png_header_only(50000, 50000), LIMITS)


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_warning_as_error_is_our_limit_error():
    # 100M pixels is under our (raised) limit but over Pillow's warning threshold, which names the limit.
    with pytest.raises(LimitExceeded, match=f"is 100000000, over the limit of {Image.MAX_IMAGE_PIXELS}"):
        probe(png_header_only(10000, 10000), ImageLimits(max_image_bytes=1 << 20, max_pixels=150_000_000))


def test_decompression_bomb_in_other_words_is_still_our_limit_error(monkeypatch):
    def open_refusing(*args, **kwargs):
        raise Image.DecompressionBombError("some future wording")

    monkeypatch.setattr(Image, "open", open_refusing)
    with pytest.raises(LimitExceeded, match="decoded pixel count is over Pillow's limit"):
        probe(b"any bytes", LIMITS)


def test_aspect_ratio_over_200_rejected_from_header():
    with pytest.raises(LimitExceeded, match=r"aspect ratio .* of the 201x1 image is 201.0, over the limit of 200"):
        probe(encode(rgb_image(1, 201), "PNG"), LIMITS)
    with pytest.raises(LimitExceeded, match=r"of the 10x2020 image is 202.0, over the limit of 200"):
        plan(ImageHeader(10, 2020, "PNG", "RGB"), PreprocessConfig.default_for(QWEN2_5))  # smart_resize's own check
    assert probe(encode(rgb_image(1, 200), "PNG"), LIMITS).width == 200


def test_stricter_aspect_limit():
    with pytest.raises(LimitExceeded, match="is 5.0, over the limit of 4"):
        probe(encode(rgb_image(10, 50), "PNG"), ImageLimits(1 << 20, 1 << 20, max_aspect_ratio=4))


def test_limits_validate_themselves():
    with pytest.raises(ValueError, match="max_aspect_ratio"):
        ImageLimits(1 << 20, 1 << 20, max_aspect_ratio=300)
    with pytest.raises(ValueError, match="positive"):
        ImageLimits(0, 1 << 20)


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_is_a_decode_error(kind):
    with pytest.raises(ImageDecodeError) as raised:
        preprocess(BAD_INPUTS[kind](), PreprocessConfig.default_for(QWEN2_5), LIMITS)
    assert not isinstance(raised.value, LimitExceeded)


def test_pillow_global_state_untouched():
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    assert Image.MAX_IMAGE_PIXELS == int(1024 * 1024 * 1024 // 4 // 3)  # Pillow's default
