"""Preprocessing settings of a checkpoint, read the way transformers 5.x reads them.

transformers has no Qwen3-VL image processor of its own: every family maps to `Qwen2VLImageProcessorPil`
(AutoImageProcessor), configured by the checkpoint's file. Where the file is silent, that class's defaults
apply, and they are Qwen2-VL's (patch 14, CLIP mean/std, 56*56 to 28*28*1280 pixels), so a Qwen3 file that
omitted its patch size would be wrong in transformers too; the checks against the VisionSpec catch that.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError
from ..models.spec import VisionSpec

log = logging.getLogger(__name__)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

# Qwen2VLImageProcessorPil's class defaults, used only for keys the checkpoint's file leaves out.
_TRANSFORMERS_DEFAULTS = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "rescale_factor": 1 / 255,
}

# What the published checkpoints' files say, for a checkpoint that has no file at all.
_PUBLISHED = {
    "qwen2_vl": {"min_pixels": 3136, "max_pixels": 12845056, "image_mean": CLIP_MEAN, "image_std": CLIP_STD},
    "qwen2_5_vl": {"min_pixels": 3136, "max_pixels": 12845056, "image_mean": CLIP_MEAN, "image_std": CLIP_STD},
    "qwen3_vl": {"min_pixels": 65536, "max_pixels": 16777216, "image_mean": HALF, "image_std": HALF},
}

# Steps we always perform; a file that switches one off describes a pipeline we do not implement.
_REQUIRED_FLAGS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the class default `resample`


@dataclass(frozen=True)
class PreprocessConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # smart_resize bounds on the resized image's pixel count
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (28 or 32)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, spec: VisionSpec) -> PreprocessConfig:
        """Settings from the checkpoint, in transformers' order of precedence: the `image_processor` entry of
        processor_config.json, else preprocessor_config.json; `default_for(spec)` when neither exists."""
        checkpoint_dir = Path(checkpoint_dir)
        settings = _read_settings(checkpoint_dir)
        if settings is None:
            log.warning("%s has no image processor settings; using the published %s ones", checkpoint_dir, spec.family)
            return cls.default_for(spec)
        return cls.from_settings(settings, spec, source=str(checkpoint_dir))

    @classmethod
    def default_for(cls, spec: VisionSpec) -> PreprocessConfig:
        """The settings of the family's published checkpoints."""
        if spec.family not in _PUBLISHED:
            raise ModelLoadError(f"no published preprocessing settings for family {spec.family!r}")
        settings = {"patch_size": spec.patch_size, **_PUBLISHED[spec.family]}
        return cls.from_settings(settings, spec, source=f"defaults for {spec.family}")

    @classmethod
    def from_settings(cls, settings: dict, spec: VisionSpec, source: str,
                       defaults: dict = _TRANSFORMERS_DEFAULTS) -> PreprocessConfig:
        """`defaults`: the processor class's values for keys the file leaves out (video_config.py passes the
        video processors' own)."""
        for flag in _REQUIRED_FLAGS:
            if settings.get(flag) is False:
                raise ModelLoadError(f"{source}: {flag}=false is not supported")
        if settings.get("resample", _BICUBIC) != _BICUBIC:
            raise ModelLoadError(f"{source}: resample={settings['resample']} is not supported (only bicubic, 3)")

        def value(key):
            found = settings.get(key)
            return defaults[key] if found is None else found

        min_pixels, max_pixels = _pixel_bounds(settings, source, defaults)
        config = cls(
            patch_size=int(value("patch_size")),
            temporal_patch_size=int(value("temporal_patch_size")),
            merge_size=int(value("merge_size")),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_mean=_per_channel(value("image_mean"), "image_mean", spec.in_channels, source),
            image_std=_per_channel(value("image_std"), "image_std", spec.in_channels, source),
            rescale_factor=float(value("rescale_factor")),
        )
        config._check(spec, source)
        return config

    def _check(self, spec: VisionSpec, source: str) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            ours, model = getattr(self, name), getattr(spec, name)
            if ours != model:
                raise ModelLoadError(f"{source}: {name} is {ours} but the vision tower's is {model}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ModelLoadError(
                f"{source}: need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}"
            )
        if any(s == 0 for s in self.image_std):
            raise ModelLoadError(f"{source}: image_std {self.image_std} has a zero")
        try:
            rescale_divisor(self.rescale_factor)
        except ValueError as exc:
            raise ModelLoadError(f"{source}: {exc}") from None


def _read_settings(checkpoint_dir: Path) -> dict | None:
    processor_file = checkpoint_dir / "processor_config.json"
    if processor_file.is_file():
        nested = load_json_object(processor_file).get("image_processor")
        if nested is not None:
            return nested
    image_processor_file = checkpoint_dir / "preprocessor_config.json"
    if image_processor_file.is_file():
        return load_json_object(image_processor_file)
    return None


def load_json_object(path: Path) -> dict:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return loaded


def _pixel_bounds(settings: dict, source: str, defaults: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) as Qwen2VLImageProcessorPil.__init__ resolves them: top-level `min_pixels` /
    `max_pixels` override `size` = {shortest_edge, longest_edge}, which defaults to the class's `size` only
    when the file has no `size` at all (a `size` missing a key fails in transformers, so it fails here)."""
    size = settings.get("size")
    if size is None:
        size = {"shortest_edge": defaults["min_pixels"], "longest_edge": defaults["max_pixels"]}
    elif not isinstance(size, dict):
        raise ModelLoadError(f"{source}: size must be an object, got {size!r}")
    size = dict(size)
    if settings.get("min_pixels") is not None:
        size["shortest_edge"] = settings["min_pixels"]
    if settings.get("max_pixels") is not None:
        size["longest_edge"] = settings["max_pixels"]
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise ModelLoadError(f"{source}: size must have shortest_edge and longest_edge (pixel counts), got {size}")
    return int(size["shortest_edge"]), int(size["longest_edge"])


def _per_channel(value, name: str, channels: int, source: str) -> tuple[float, ...]:
    # transformers' normalize accepts one number for all channels, or one per channel.
    if isinstance(value, (int, float)):
        return (float(value),) * channels
    if len(value) != channels:
        raise ModelLoadError(f"{source}: {name} has {len(value)} values for {channels} channels")
    return tuple(float(v) for v in value)


@lru_cache(maxsize=8)
def rescale_divisor(rescale_factor: float) -> np.float32:
    """The float32 d with float32(v) / d == float32(float64(v) * rescale_factor) for every uint8 v.

    A float32 division is one pass; transformers' float64 product and cast are three. For 1/255 the two agree
    on all 256 values; a factor for which they do not is rejected (ValueError) when the config is built.
    """
    divisor = np.float32(1 / rescale_factor)
    values = np.arange(256)
    reference = (values.astype(np.float64) * rescale_factor).astype(np.float32)
    if not np.array_equal(values.astype(np.float32) / divisor, reference):
        raise ValueError(f"rescale_factor {rescale_factor} is not supported (no exact float32 divisor)")
    return divisor
