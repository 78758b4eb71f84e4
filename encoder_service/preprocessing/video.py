"""A video's plan and its frame groups' pixel values, equal to transformers' video processors.

    probe_video (video_decode.py)          -> VideoProbe  the header: size, frame count, frame rate
    plan_video(probe, cfg, options, limits) -> VideoPlan   sampled frames, resized size, grid, the metadata the
                                                           language model needs; known before decoding
    iter_frame_groups (video_decode.py)    -> [T, H, W, 3] uint8, one frame group at a time, in order
    preprocess_group(frames, plan, cfg)    -> that group's pixel_values rows, [h*w, C*T*P*P]

A frame group is the T = temporal_patch_size (2) consecutive sampled frames one temporal patch spans. The
towers attend within a group only, so a group is encoded as its own grid (1, h, w), and the video's rows
(grid (t, h, w): t groups) are the groups' rows one after the other. An odd frame count is padded by
repeating the last frame (grid_t = ceil(frames / T)), as transformers pads.

transformers' rules (5.24):
  Qwen2VLVideoProcessor  sample_frames: by num_frames (rounded to a multiple of T) or by fps (clamped to
                         min_frames..max_frames and the frame count, floored to a multiple of T), indices
                         torch.arange(0, total, total / n).int(); smart_resize per frame within `size`.
  Qwen3VLVideoProcessor  sample_frames: num_frames, else int(total / fps_source * fps) clamped to
                         min_frames..max_frames and the frame count, the source's fps taken as 24 when
                         unknown; indices np.linspace(0, total - 1, n).round(); smart_resize of all
                         sampled frames at once within the budget `size.longest_edge`, at least T frames.
  Both resize bicubic with antialias (torch_ops.resize), fuse rescale and normalize (torch_ops.normalize),
  then patchify t-major (torch_ops.patchify, group by group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..errors import InvalidInput, LimitExceeded
from ..models.spec import num_tokens
from . import torch_ops
from .limits import MAX_ASPECT_RATIO, VideoLimits, check_aspect_ratio
from .resize import smart_resize
from .video_config import VideoConfig

# What transformers' VideoMetadata assumes when a video's frame rate is unknown.
ASSUMED_FPS = 24
FRAMES = "frames"  # VideoProbe.container of a video given as a list of images


@dataclass(frozen=True)
class VideoProbe:
    """What the header says (video_decode.py), or a list of frames given as images."""

    width: int
    height: int
    total_frames: int
    fps: float | None  # the source's frames per second; None when unknown
    duration_s: float | None  # None when unknown (frames given as images)
    container: str  # "mp4", "mov", "webm", "mkv", or FRAMES
    codec: str  # "h264", "vp9", ..., or the images' formats ("JPEG", "PNG")


@dataclass(frozen=True)
class VideoOptions:
    """What a caller may ask for, as transformers' video processors take it per call.

    fps / num_frames: sample at that rate / that many frames (mutually exclusive). Either one turns
    sampling on (in transformers they do nothing while do_sample_frames is off, which Qwen2-VL's processor
    is by default: a caller asking for fps=1 wants one frame a second). sample_frames: on or off explicitly;
    None takes the checkpoint's `do_sample_frames` for a container file and off for a list of frames (taken
    to be the frames to encode). min_pixels / max_pixels: transformers' `size` (shortest_edge /
    longest_edge): per frame for Qwen2-VL's processor, over the whole video for Qwen3-VL's.
    """

    fps: float | None = None
    num_frames: int | None = None
    sample_frames: bool | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None

    def __post_init__(self):
        if self.fps is not None and not (isinstance(self.fps, (int, float)) and not isinstance(self.fps, bool)
                                         and math.isfinite(self.fps) and self.fps > 0):
            raise InvalidInput(f"fps must be a positive number, got {self.fps!r}")
        for name in ("num_frames", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
        if self.fps is not None and self.num_frames is not None:
            raise InvalidInput("fps and num_frames are mutually exclusive: give one")
        if self.sample_frames is False and (self.fps is not None or self.num_frames is not None):
            raise InvalidInput("fps and num_frames sample frames: they need sample_frames on (or unset)")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise InvalidInput(f"min_pixels {self.min_pixels} is over max_pixels {self.max_pixels}")


@dataclass(frozen=True)
class VideoPlan:
    """Everything encode answers with, and what decoding and preprocessing each frame group need."""

    frame_indices: tuple[int, ...]  # sampled source frames, non-decreasing (Qwen3 may repeat one)
    total_frames: int  # frames in the source
    fps: float | None  # the source's frame rate as transformers' metadata holds it (None: unknown)
    source_size: tuple[int, int]  # (height, width) of every source frame
    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]  # (frame groups, patch rows, patch columns)
    temporal_patch_size: int
    merge_size: int

    @property
    def num_groups(self) -> int:
        return self.grid_thw[0]

    @property
    def group_grid(self) -> tuple[int, int, int]:
        """The grid each frame group is encoded as."""
        return (1, *self.grid_thw[1:])

    @property
    def tokens_per_group(self) -> int:
        return num_tokens(self.group_grid, self.merge_size)

    @property
    def num_tokens(self) -> int:
        return num_tokens(self.grid_thw, self.merge_size)

    @cached_property
    def padded_indices(self) -> tuple[int, ...]:
        """frame_indices with the last repeated up to num_groups * T: what the groups hold, in order."""
        pad = -len(self.frame_indices) % self.temporal_patch_size
        return self.frame_indices + self.frame_indices[-1:] * pad

    def group_frames(self, group: int) -> tuple[int, ...]:
        """The source frames of frame group `group`, in order (T of them)."""
        t = self.temporal_patch_size
        return self.padded_indices[group * t : (group + 1) * t]

    @property
    def frames_to_decode(self) -> int:
        """Decoding stops after this many source frames."""
        return self.frame_indices[-1] + 1

    @property
    def sampled_fps(self) -> float:
        """transformers' VideoMetadata.sampled_fps: the sampled frames' rate (24 when the source's is unknown)."""
        if self.fps is None:
            return ASSUMED_FPS
        return len(self.frame_indices) / self.total_frames * self.fps

    @property
    def second_per_grid_t(self) -> float:
        """Qwen2.5-VL's `second_per_grid_ts` entry for this video: temporal_patch_size / sampled_fps, a float
        (Qwen2_5_VLProcessor). Its M-RoPE temporal position of group g is int(g * tokens_per_second * this)
        in transformers 5.24; 5.17's get_rope_index truncated this value to an int first."""
        return self.temporal_patch_size / self.sampled_fps

    @cached_property
    def group_timestamps(self) -> tuple[float, ...]:
        """Qwen3-VL's time of each frame group in seconds (Qwen3VLProcessor._calculate_timestamps): the mean
        of its first and last frame's index / fps (24 when unknown). The prompt writes each group as
        `timestamp_text(t)`, vision start, the group's tokens, vision end."""
        fps = ASSUMED_FPS if self.fps is None else self.fps
        times = [index / fps for index in self.padded_indices]
        t = self.temporal_patch_size
        return tuple((times[i] + times[i + t - 1]) / 2 for i in range(0, len(times), t))


def timestamp_text(seconds: float) -> str:
    """How Qwen3-VL's prompt writes a frame group's time."""
    return f"<{seconds:.1f} seconds>"


def plan_video(probe: VideoProbe, cfg: VideoConfig, options: VideoOptions, limits: VideoLimits) -> VideoPlan:
    """Sample, size and grid the video as transformers' video processor of `cfg` would, called with
    `options` on the probed video's frames and metadata. Raises InvalidInput (a request transformers
    refuses) or LimitExceeded (sampled frames, tokens, aspect ratio)."""
    fps = probe.fps
    if _samples(probe, cfg, options):
        if cfg.is_qwen3:
            indices, fps = _sample_qwen3(probe.total_frames, fps, cfg, options)
        else:
            indices = _sample_qwen2(probe.total_frames, fps, cfg, options)
    else:
        indices = tuple(range(probe.total_frames))
    if len(indices) > limits.max_frames:
        raise LimitExceeded("sampled frame count", len(indices), limits.max_frames,
                            hint="sample fewer frames (fps or num_frames)")
    height, width = _resized_size(probe, cfg, options, len(indices))
    pixels = cfg.pixels
    grid = (-(-len(indices) // pixels.temporal_patch_size), height // pixels.patch_size, width // pixels.patch_size)
    plan = VideoPlan(indices, probe.total_frames, fps, (probe.height, probe.width), height, width, grid,
                     pixels.temporal_patch_size, pixels.merge_size)
    if plan.num_tokens > limits.max_tokens:
        raise LimitExceeded("token count of the video", plan.num_tokens, limits.max_tokens,
                            hint="sample fewer frames or lower max_pixels")
    return plan


def preprocess_group(frames: np.ndarray | torch.Tensor, plan: VideoPlan, cfg: VideoConfig, *,
                     device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One frame group's pixel_values: frames [T, H, W, 3] uint8 RGB (iter_frame_groups) -> [h*w, C*T*P*P]
    in `dtype` on `device` (default: the frames' own). Equal bit for bit to the group's rows of transformers'
    video processor run on that kind of device (the resize differs by device, torch_ops.resize).

    The frames go to the device as they are, then become [T, 3, H, W] there (what transformers builds from
    decoded frames: from_numpy, permute, contiguous), and are resized, normalized, cast and patchified.
    """
    video = torch.as_tensor(frames)
    expected = (plan.temporal_patch_size, *plan.source_size, 3)
    if tuple(video.shape) != expected or video.dtype != torch.uint8:
        raise ValueError(f"frames must be {list(expected)} uint8, got {list(video.shape)} {video.dtype}")
    if device is not None:
        video = video.to(device)
    video = video.permute(0, 3, 1, 2).contiguous()
    return torch_ops.to_pixel_values(video, plan.resized_height, plan.resized_width, cfg.pixels, dtype)


def _samples(probe: VideoProbe, cfg: VideoConfig, options: VideoOptions) -> bool:
    if options.sample_frames is not None:
        return options.sample_frames
    if options.fps is not None or options.num_frames is not None:
        return True
    return cfg.do_sample_frames and probe.container != FRAMES


def _requested(cfg: VideoConfig, options: VideoOptions) -> tuple[float | None, int | None]:
    """(fps, num_frames) of the call: the caller's choice replaces the checkpoint's pair."""
    if options.fps is not None or options.num_frames is not None:
        return options.fps, options.num_frames
    return cfg.fps, cfg.num_frames


def _sample_qwen2(total: int, source_fps: float | None, cfg: VideoConfig, options: VideoOptions) -> tuple[int, ...]:
    """Qwen2VLVideoProcessor.sample_frames."""
    fps, num_frames = _requested(cfg, options)
    t = cfg.pixels.temporal_patch_size
    if num_frames is not None:
        num_frames = round(num_frames / t) * t
    elif fps is not None:
        if source_fps is None:
            raise InvalidInput("sampling at an fps needs the video's frame rate, which its header does not give")
        max_frames = math.floor(min(cfg.max_frames, total) / t) * t
        wanted = min(max(total / source_fps * fps, cfg.min_frames), max_frames, total)
        num_frames = math.floor(wanted / t) * t
    else:
        raise InvalidInput("sampling frames needs fps or num_frames (the checkpoint sets neither)")
    if num_frames > total:
        raise InvalidInput(f"cannot sample {num_frames} frames from a video of {total}")
    if num_frames < 1:
        raise InvalidInput(f"sampling leaves no frames: the video has {total}, sampled in groups of {t}")
    return tuple(torch.arange(0, total, total / num_frames).int().tolist())


def _sample_qwen3(total: int, source_fps: float | None, cfg: VideoConfig,
                  options: VideoOptions) -> tuple[tuple[int, ...], float]:
    """Qwen3VLVideoProcessor.sample_frames: the indices, and the frame rate it leaves in the metadata (24
    when the source's is unknown)."""
    fps, num_frames = _requested(cfg, options)
    source_fps = ASSUMED_FPS if source_fps is None else source_fps
    if num_frames is None:
        num_frames = int(total / source_fps * fps)
        num_frames = min(max(num_frames, cfg.min_frames), cfg.max_frames, total)
    return tuple(np.linspace(0, total - 1, num_frames).round().astype(int).tolist()), source_fps


def _resized_size(probe: VideoProbe, cfg: VideoConfig, options: VideoOptions, num_frames: int) -> tuple[int, int]:
    """(height, width) every frame is resized to: the processor's resize for `num_frames` sampled frames."""
    pixels = cfg.pixels
    min_pixels = pixels.min_pixels if options.min_pixels is None else options.min_pixels
    max_pixels = pixels.max_pixels if options.max_pixels is None else options.max_pixels
    if min_pixels > max_pixels:
        raise InvalidInput(f"min_pixels {min_pixels} is over max_pixels {max_pixels}")
    factor, t = pixels.factor, pixels.temporal_patch_size
    if not cfg.is_qwen3:
        if cfg.cap_pixels_per_frame:
            total_pixels = int(cfg.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * t // num_frames), int(min_pixels * 1.05))
        return smart_resize(probe.height, probe.width, factor, min_pixels, max_pixels)
    if cfg.cap_pixels_per_frame:
        frame_cap = cfg.max_video_tokens * factor * factor
        max_pixels = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05)) * num_frames
    return smart_resize_frames(num_frames, probe.height, probe.width, t, factor, min_pixels, max_pixels)


def smart_resize_frames(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                        min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video `smart_resize`, step for step: the pixel bounds are over all frames
    (frames rounded to a multiple of temporal_factor), and sides under `factor` are first scaled up. Its
    ValueErrors are ours: fewer frames than temporal_factor (InvalidInput), aspect ratio over 200
    (LimitExceeded)."""
    if num_frames < temporal_factor:
        raise InvalidInput(f"Qwen3-VL's video processor needs at least {temporal_factor} frames, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect_ratio(width, height, MAX_ASPECT_RATIO)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
