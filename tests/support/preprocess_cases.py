"""What the preprocessing parity tests feed both us and transformers: the published checkpoints' processor
settings, the photographs in tests/data, and synthetic images of every size class, mode and format that
takes its own path through the processors. Shared by tests/unit (PIL backend, torchvision backend on the
CPU), tests/engines/test_torchvision_processor.py (torchvision backend vs transformers on the CPU) and
tests/gpu (on CUDA).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import ExifTags, Image, ImageOps, PngImagePlugin

from encoder_service.models.spec import VisionSpec
from encoder_service.preprocessing import ImageLimits, PreprocessConfig
from tests.support.images import png_header_only

DATA = Path(__file__).parents[1] / "data"
PHOTOS = ["grace_hopper.jpg", "rocket.jpg", "camera.png"]  # real photographs, see data/README.md

QWEN2_5 = VisionSpec("qwen2_5_vl", "qwen2_5_vl", 14, 2, 2, 3, 2048, 0)
QWEN3 = VisionSpec("qwen3_vl", "qwen3_vl", 16, 2, 2, 3, 2048, 3)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# The published checkpoints' preprocessor_config.json, in each family's own form.
HUB_CONFIGS = {
    "qwen2_5": (QWEN2_5, {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                          "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                          "image_processor_type": "Qwen2VLImageProcessor"}),
    "qwen3": (QWEN3, {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                      "image_processor_type": "Qwen2VLImageProcessorFast"}),
}
# max_pixels far below the photos' size (like the tiny test checkpoints): 5x bicubic reductions (Qwen2.5).
SMALL_SETTINGS = {"min_pixels": 8 * 28 * 28, "max_pixels": 16 * 28 * 28}

LIMITS = ImageLimits(max_image_bytes=32 << 20, max_pixels=67108864)

ODD_SIZES = [  # (height, width)
    (77, 123),  # sides not multiples of 28 or 32
    (10, 10),  # below min_pixels: scaled up
    (28, 5000),  # aspect ratio 178: one patch row (Qwen2.5)
    (5000, 25),  # aspect ratio 200, the largest accepted
    (301, 5),  # side below half a factor rounds to 0 before the min_pixels step
    (70, 126),  # 70 = 2.5 * 28: Python's round() goes to the even 2 (Qwen2.5)
    (272, 300),  # 272 = 8.5 * 32: likewise, above Qwen3's min_pixels
]


def write_checkpoint(path: Path, settings: dict, filename: str = "preprocessor_config.json") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / filename).write_text(json.dumps(settings))
    return path


def config_and_processor(path: Path, spec: VisionSpec, settings: dict, processor_class):
    """(our PreprocessConfig, transformers' `processor_class`), both read from one checkpoint directory
    (made at `path`) holding the processor `settings`."""
    checkpoint = write_checkpoint(path, settings)
    return PreprocessConfig.from_checkpoint(checkpoint, spec), processor_class.from_pretrained(checkpoint)


def family_fixture(processor_class):
    """A module-scoped `family` fixture over the published checkpoints (params: HUB_CONFIGS' names): (our
    PreprocessConfig, transformers' `processor_class`), both read from one checkpoint directory. A test
    module takes it as `family = family_fixture(SomeProcessor)`."""

    @pytest.fixture(params=sorted(HUB_CONFIGS), scope="module")
    def family(request, tmp_path_factory):
        spec, settings = HUB_CONFIGS[request.param]
        return config_and_processor(tmp_path_factory.mktemp(request.param), spec, settings, processor_class)

    return family


def encode(image: Image.Image, fmt: str, **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return buffer.getvalue()


def texture(height: int, width: int, channels: int, seed: int = 0) -> np.ndarray:
    """uint8 [H, W, C]: smooth gradients plus noise, so bicubic overshoots and clips like on real edges."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = 127 + 100 * np.sin(x[..., None] / 7.0 + y[..., None] / 11.0 + np.arange(channels))
    return np.clip(base + rng.normal(0, 40, (height, width, channels)), 0, 255).astype(np.uint8)


def rgb_image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(texture(height, width, 3, seed))


def photo_1080p_jpeg() -> bytes:
    photo = Image.open(DATA / "rocket.jpg").resize((1920, 1080), Image.Resampling.BICUBIC)
    return encode(photo, "JPEG", quality=90)


def rgba_image() -> Image.Image:
    alpha = np.tile(np.linspace(0, 255, 90).astype(np.uint8), (60, 1))[..., None]
    return Image.fromarray(np.concatenate([texture(60, 90, 3), alpha], axis=-1))


def palette_image() -> Image.Image:
    return rgb_image(60, 90).quantize(colors=64)


def animated_gif() -> bytes:
    frames = [rgb_image(60, 90, seed).quantize(colors=32) for seed in (1, 2, 3)]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=40, loop=0)


def cmyk_jpeg() -> bytes:
    return encode(Image.frombytes("CMYK", (90, 60), texture(60, 90, 4).tobytes()), "JPEG", quality=92)


def multi_picture_jpeg() -> bytes:
    """What phones write (MPO): Pillow's JPEG opener reads it; the first picture is the image."""
    return encode(rgb_image(60, 90, 1), "MPO", save_all=True, append_images=[rgb_image(60, 90, 2)])


def loaded(data: bytes, exif_orientation: bool = True) -> Image.Image:
    """`data` as the engines hand it to the processor: decoded by Pillow and turned upright by its EXIF
    orientation (`ImageOps.exif_transpose`: transformers' `load_image`, vLLM's loader), or as stored. The mode
    is kept, so the processor's convert_to_rgb composites transparency over white, as vLLM's loader does (not
    `load_image`'s plain convert("RGB"): decode.py, to_rgb)."""
    image = Image.open(io.BytesIO(data))
    return ImageOps.exif_transpose(image) if exif_orientation else image


def orientation_exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation  # 6: rotate 90 degrees clockwise to view
    return exif


def exif_jpeg(orientation: int) -> bytes:
    """A 90x60 JPEG (as stored) with that EXIF orientation: 5-8 show it 60x90."""
    return encode(rgb_image(60, 90), "JPEG", exif=orientation_exif(orientation))


def exif_rotated_jpeg() -> bytes:
    return exif_jpeg(6)


def png_exif_after_pixels(orientation: int) -> bytes:
    """A PNG whose eXIf chunk follows its pixel data (the PNG spec's first edition allowed it; Pillow writes it
    before): Pillow reads it only when it decodes the pixels."""
    data = encode(rgb_image(60, 90), "PNG", exif=orientation_exif(orientation))
    start = data.index(b"eXIf") - 4
    end = start + 12 + int.from_bytes(data[start:start + 4], "big")
    chunk, rest = data[start:end], data[:start] + data[end:]
    iend = rest.index(b"IEND") - 4
    return rest[:iend] + chunk + rest[iend:]


def png_xmp_orientation(orientation: int) -> bytes:
    """Orientation from XMP only (Pillow's getexif reads tiff:Orientation there when the EXIF has none)."""
    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", f'<x:xmpmeta><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>')
    return encode(rgb_image(60, 90), "PNG", pnginfo=info)


def jpeg_with_broken_exif() -> bytes:
    """An APP1 Exif segment Pillow cannot read: no orientation (vLLM's loader ignores the error too)."""
    data = exif_jpeg(6)
    at = data.index(b"Exif\x00\x00") + 6
    return data[:at] + b"XX" + data[at + 2:]  # the TIFF header's byte order: neither II nor MM


# Photos with an EXIF orientation, in every form Pillow reads one from: name -> bytes maker.
ORIENTED = {f"exif_jpeg_orientation_{o}": (lambda o=o: exif_jpeg(o)) for o in range(1, 9)} | {
    "exif_png_rgba": lambda: encode(rgba_image(), "PNG", exif=orientation_exif(8)),
    "exif_png_palette_transparent": lambda: encode(palette_image(), "PNG", transparency=5, exif=orientation_exif(5)),
    "exif_png_after_pixels": lambda: png_exif_after_pixels(6),
    "exif_png_xmp_only": lambda: png_xmp_orientation(7),
    "exif_webp": lambda: encode(rgb_image(60, 90), "WEBP", quality=80, exif=orientation_exif(6)),
    "exif_tiff_tag": lambda: encode(rgb_image(60, 90), "TIFF", tiffinfo={ExifTags.Base.Orientation: 8}),
    "exif_broken": jpeg_with_broken_exif,
}


# Modes and formats, each a path of its own through convert_to_rgb or the decoders: name -> bytes maker.
IMAGES = {
    "rgba_png": lambda: encode(rgba_image(), "PNG"),
    "la_png": lambda: encode(rgba_image().convert("LA"), "PNG"),
    "palette_png": lambda: encode(palette_image(), "PNG"),
    "palette_png_transparent_index": lambda: encode(palette_image(), "PNG", transparency=5),
    "grayscale_png_transparent_value": lambda: encode(rgb_image(60, 90).convert("L"), "PNG", transparency=128),
    "grayscale_l_png": lambda: encode(rgb_image(60, 90).convert("L"), "PNG"),
    "bilevel_1_png": lambda: encode(rgb_image(60, 90).convert("1"), "PNG"),
    "16bit_png": lambda: encode(Image.fromarray(texture(60, 90, 1)[..., 0].astype(np.uint16) * 257), "PNG"),
    "int32_i_tiff": lambda: encode(Image.fromarray(texture(60, 90, 1)[..., 0].astype(np.int32) * 2 - 100), "TIFF"),
    "float_f_tiff": lambda: encode(Image.fromarray(texture(60, 90, 1)[..., 0].astype(np.float32) * 1.5), "TIFF"),
    "cmyk_jpeg": cmyk_jpeg,
    "multi_picture_jpeg": multi_picture_jpeg,
    "animated_gif_first_frame": animated_gif,
    "bmp": lambda: encode(rgb_image(60, 90), "BMP"),
    "tiff": lambda: encode(rgb_image(60, 90), "TIFF", compression="tiff_lzw"),
    "webp_lossy": lambda: encode(rgb_image(60, 90), "WEBP", quality=80),
    "webp_alpha": lambda: encode(rgba_image(), "WEBP", lossless=True),
} | ORIENTED

# JPEGs of each kind a decoder treats differently: chroma subsampling, progressive, grayscale, large.
JPEGS = {
    "grace_hopper": lambda: (DATA / "grace_hopper.jpg").read_bytes(),
    "rocket": lambda: (DATA / "rocket.jpg").read_bytes(),
    "photo_1080p": photo_1080p_jpeg,
    "subsampling_420": lambda: encode(rgb_image(333, 517, 4), "JPEG", quality=90, subsampling=2),
    "subsampling_422": lambda: encode(rgb_image(301, 409, 5), "JPEG", quality=85, subsampling=1),
    "subsampling_444": lambda: encode(rgb_image(613, 1999, 3), "JPEG", quality=95, subsampling=0),
    "progressive": lambda: encode(rgb_image(450, 299, 6), "JPEG", progressive=True),
    "grayscale": lambda: encode(rgb_image(199, 301, 7).convert("L"), "JPEG"),
    "exif_rotated": exif_rotated_jpeg,
}


# Every image above under one name: the photographs (the JPEG ones among JPEGS), the JPEG kinds, the odd
# sizes (as PNG), the modes and formats.
CASES = {"photo_camera_png": lambda: (DATA / "camera.png").read_bytes()} | {
    f"jpeg_{name}": make for name, make in JPEGS.items()} | {
    f"png_{h}x{w}": lambda h=h, w=w: encode(rgb_image(h, w), "PNG") for h, w in ODD_SIZES} | IMAGES


def corrupt_png() -> bytes:
    data = bytearray(encode(rgb_image(60, 90), "PNG"))
    data[len(data) // 2] ^= 0xFF  # inside IDAT: CRC and zlib stream both break
    return bytes(data)


# Not images, or broken ones: each must be an ImageDecodeError (never a LimitExceeded, never a crash).
BAD_INPUTS = {
    "empty": lambda: b"",
    "random_bytes": lambda: np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
    "text_file": lambda: b"name,value\nimage,not really\n" * 20,
    "zero_width_png": lambda: png_header_only(0, 10),
    "zero_height_png": lambda: png_header_only(10, 0),
    "truncated_jpeg": lambda: (DATA / "grace_hopper.jpg").read_bytes()[:20000],
    "corrupt_png": corrupt_png,
    "png_header_without_pixels": lambda: png_header_only(64, 64),
    "unsupported_format_ppm": lambda: encode(rgb_image(10, 10), "PPM"),
}
