"""Video preprocessing settings of a checkpoint, read the way transformers 5.x reads them (AutoVideoProcessor).

The file: the `video_processor` entry of processor_config.json, else video_preprocessor_config.json, else the
image processor's preprocessor_config.json (Qwen2-VL and Qwen2.5-VL publish no video file: their videos take
the image file's min_pixels / max_pixels, per frame).

The processor class, whose rules and class defaults apply: the file's `video_processor_type`; else its
`image_processor_type` with "ImageProcessor" -> "VideoProcessor" where that names a class; else the one
transformers maps the model type to.

  Qwen2VLVideoProcessor  (qwen2_vl, qwen2_5_vl) no frame sampling by default; `size` bounds each frame's
                         pixels; top-level min_pixels / max_pixels in the file override `size`.
  Qwen3VLVideoProcessor  (qwen3_vl, qwen3_vl_moe) samples at 2 fps, 4..768 frames; `size.longest_edge` is a
                         pixel budget over all sampled frames; min_pixels / max_pixels in the file are ignored
                         (its __init__ does not read them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from ..models.spec import VisionSpec
from .config import CLIP_MEAN, CLIP_STD, HALF, PreprocessConfig, load_json_object

log = logging.getLogger(__name__)

QWEN2_VIDEO = "Qwen2VLVideoProcessor"
QWEN3_VIDEO = "Qwen3VLVideoProcessor"

# Each class's defaults for keys the file leaves out (transformers 5.24 class attributes).
_CLASS_DEFAULTS = {
    QWEN2_VIDEO: {
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 128 * 28 * 28,
        "max_pixels": 28 * 28 * 768, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "rescale_factor": 1 / 255,
        "do_sample_frames": False, "fps": None, "num_frames": None, "min_frames": 4, "max_frames": 768,
        "cap_pixels_per_frame": False, "max_video_tokens": 128000,
    },
    QWEN3_VIDEO: {
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 128 * 32 * 32,
        "max_pixels": 32 * 32 * 768, "image_mean": HALF, "image_std": HALF, "rescale_factor": 1 / 255,
        "do_sample_frames": True, "fps": 2, "num_frames": None, "min_frames": 4, "max_frames": 768,
        "cap_pixels_per_frame": False, "max_video_tokens": 768,
    },
}
# transformers' VIDEO_PROCESSOR_MAPPING for our families (qwen3_vl_moe's family is qwen3_vl).
_BY_FAMILY = {"qwen2_vl": QWEN2_VIDEO, "qwen2_5_vl": QWEN2_VIDEO, "qwen3_vl": QWEN3_VIDEO}


@dataclass(frozen=True)
class VideoConfig:
    processor: str  # QWEN2_VIDEO or QWEN3_VIDEO: whose sampling and resize rules apply
    # Patch sizes, `size` as (min_pixels, max_pixels) = (shortest_edge, longest_edge), mean, std, rescale.
    pixels: PreprocessConfig
    do_sample_frames: bool
    fps: float | None  # frames per second to sample, unless the caller asks otherwise
    num_frames: int | None  # or a number of frames
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool  # qwen-vl-utils' per-frame share of a total pixel budget (off by default)
    max_video_tokens: int

    @property
    def is_qwen3(self) -> bool:
        return self.processor == QWEN3_VIDEO

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, spec: VisionSpec) -> VideoConfig:
        """The settings transformers' AutoVideoProcessor would load from `checkpoint_dir`; where it would find
        no file at all (and refuse), the class defaults of the family's video processor, with a warning."""
        checkpoint_dir = Path(checkpoint_dir)
        settings = _read_settings(checkpoint_dir)
        if settings is None:
            log.warning("%s has no video processor settings; using %s's defaults", checkpoint_dir,
                        _BY_FAMILY[spec.family])
            settings = {}
        return cls.from_settings(settings, spec, source=str(checkpoint_dir))

    @classmethod
    def from_settings(cls, settings: dict, spec: VisionSpec, source: str) -> VideoConfig:
        processor = _processor_class(settings, spec, source)
        defaults = _CLASS_DEFAULTS[processor]
        if processor == QWEN3_VIDEO:  # its __init__ has no min_pixels / max_pixels override of `size`
            settings = {k: v for k, v in settings.items() if k not in ("min_pixels", "max_pixels")}
        pixels = PreprocessConfig.from_settings(settings, spec, source, defaults)

        def value(key):
            found = settings.get(key)
            return defaults[key] if found is None else found

        config = cls(
            processor=processor,
            pixels=pixels,
            do_sample_frames=_flag(value("do_sample_frames"), "do_sample_frames", source),
            fps=None if value("fps") is None else _positive(value("fps"), "fps", source, float),
            num_frames=None if value("num_frames") is None else _positive(value("num_frames"), "num_frames", source),
            min_frames=_positive(value("min_frames"), "min_frames", source),
            max_frames=_positive(value("max_frames"), "max_frames", source),
            cap_pixels_per_frame=_flag(value("cap_pixels_per_frame"), "cap_pixels_per_frame", source),
            max_video_tokens=_positive(value("max_video_tokens"), "max_video_tokens", source),
        )
        if config.fps is not None and config.num_frames is not None:
            # transformers raises on every sampled call then ("mutually exclusive").
            raise ModelLoadError(f"{source}: fps and num_frames are both set; a video processor takes one")
        return config


def _read_settings(checkpoint_dir: Path) -> dict | None:
    processor_file = checkpoint_dir / "processor_config.json"
    if processor_file.is_file():
        nested = load_json_object(processor_file).get("video_processor")
        if nested is not None:
            return nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (checkpoint_dir / name).is_file():
            return load_json_object(checkpoint_dir / name)
    return None


def _processor_class(settings: dict, spec: VisionSpec, source: str) -> str:
    name = settings.get("video_processor_type")
    if name is None:
        inferred = str(settings.get("image_processor_type", "")).replace("ImageProcessor", "VideoProcessor")
        name = inferred if inferred in _CLASS_DEFAULTS else _BY_FAMILY[spec.family]
    if name not in _CLASS_DEFAULTS:
        raise ModelLoadError(f"{source}: video processor {name!r} is not supported ({', '.join(_CLASS_DEFAULTS)})")
    return name


def _flag(value, name: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {name} must be true or false, got {value!r}")
    return value


def _positive(value, name: str, source: str, kind=int):
    number_types = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, number_types) or not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{source}: {name} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)
