"""An encode's videos, from the request to the engine's input, one frame group at a time:

  read     the video: a container file's bytes inline, a list of frames (each an image file's bytes), or a
           file GET from an allow-listed URL (urls.py)
  probe    on a CPU thread, before encode answers: the header, every limit checked (preprocessing/
           video_decode.py: probe_video), then the plan (video.py: plan_video, transformers' sampling and
           sizing: the grid, the rows per frame group, the language model's metadata) and the cache key (a
           digest of the bytes and of the plan's sampled frames and size, or the caller's id with the content
           tag of both: cache/video_keys.py). Nothing is decoded past what opening the file decodes.
  prepare  on a CPU thread, per frame group job (`GroupJob`, what the engine's Job carries): the group's frames
           from the video's one decoder (`VideoDecoder`: in order; a group decoded while another thread asked
           for a later one is kept for its own job), then resize, normalize and patchify as torch ops on the
           model's device (video.py: preprocess_group; on CUDA on the thread's own stream).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from encoder_service import errors
from encoder_service.cache import CacheKey
from encoder_service.cache.video_keys import group_key, video_caller_key, video_key, video_tag
from encoder_service.core.types import VideoInput
from encoder_service.core.urls import UrlFetcher
from encoder_service.engine.engine import GridTHW
from encoder_service.preprocessing import (
    VideoConfig, VideoLimits, VideoOptions, VideoPlan, iter_frame_groups, plan_video, preprocess_group, probe_video,
)  # fmt: skip
from encoder_service.preprocessing.backends import ThreadStreams

Video = bytes | tuple[bytes, ...]  # a container file, or its frames as image files


@dataclass(frozen=True)
class ProbedVideo:
    key: CacheKey
    plan: VideoPlan
    video: Video
    content_tag: int = 0  # of the bytes and the plan, under a caller id (cache/video_keys.py); 0 for content keys

    def group_keys(self) -> list[CacheKey]:
        return [group_key(self.key, g) for g in range(self.plan.num_groups)]


class VideoDecoder:
    """One video's frame groups for the CPU threads that prepare them: one decoder, in order (preprocessing/
    video_decode.py: iter_frame_groups holds one group's frames at a time). Several threads may ask at once:
    the one that holds the lock decodes up to its group, keeping the groups of `todo` it passes (up to `keep`
    of them, the oldest dropped first) for the threads that will ask for them; a group asked for after the
    decoder went past it and dropped it (a group encoded again) restarts decoding from the first frame."""

    def __init__(self, video: Video, plan: VideoPlan, limits: VideoLimits, *, todo: Sequence[int], keep: int):
        self._video, self._plan, self._limits = video, plan, limits
        self._todo, self._keep = frozenset(todo), keep
        self._lock = threading.Lock()
        self._groups = None  # the decoder: an iterator of [T, H, W, 3] uint8 arrays, opened on first use
        self._next = 0  # the group it yields next
        self._ahead: dict[int, np.ndarray] = {}  # decoded, not asked for yet
        self._failure: errors.EncoderServiceError | None = None
        self._closed = False

    def group(self, g: int) -> np.ndarray:
        """Frame group `g`'s frames [T, H, W, 3] uint8 (CPU thread)."""
        with self._lock:
            frames = self._ahead.pop(g, None)
            if frames is not None:
                return frames
            if self._closed:
                raise errors.Unavailable("the video's encode ended before this frame group was prepared")
            if self._failure is not None:  # the decoder stopped at an earlier group: it is done
                raise self._failure
            if self._groups is None or g < self._next:
                self._restart()
            while True:
                try:
                    frames = next(self._groups)
                except errors.EncoderServiceError as exc:  # a corrupt or truncated stream, a limit
                    self._failure = exc
                    raise
                except StopIteration:  # cannot happen for g < num_groups: the decoder raises why first
                    raise errors.VideoDecodeError(f"the video has no frame group {g}") from None
                index, self._next = self._next, self._next + 1
                if index == g:
                    return frames
                if index in self._todo:
                    self._ahead[index] = frames
                    while len(self._ahead) > self._keep:
                        del self._ahead[min(self._ahead)]

    def _restart(self) -> None:
        if self._groups is not None:
            self._groups.close()
        self._groups, self._next = iter_frame_groups(self._video, self._plan, self._limits), 0

    def close(self) -> None:
        """Drop the decoder and what it kept (any thread; a prepare asking later fails)."""
        with self._lock:
            self._closed = True
            self._ahead.clear()
            if self._groups is not None:
                self._groups.close()
                self._groups = None


@dataclass(frozen=True)
class GroupJob:
    """What the engine's prepare gets for a frame group (engine.py: Job.data)."""

    decoder: VideoDecoder
    plan: VideoPlan
    group: int


class VideoReader:
    """`cfg` and `limits` plan and bound videos; `urls` fetches URL videos; `video_fp` and `hash_algo` make
    the keys (cache/video_keys.py); frame groups are prepared on `device` in `dtype` (the tower's)."""

    def __init__(self, cfg: VideoConfig, limits: VideoLimits, urls: UrlFetcher, *, video_fp: str, hash_algo: str,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.limits, self.urls = cfg, limits, urls
        self._video_fp, self._hash = video_fp, hash_algo
        self._dtype = dtype
        self._streams = ThreadStreams(device)

    async def read(self, index: int, video: VideoInput) -> Video:
        given = [name for name in ("data", "frames", "url") if getattr(video, name) is not None]
        if len(given) != 1:
            raise errors.InvalidInput(f"video {index}: give exactly one of data, frames or url (got "
                                      f"{', '.join(given) or 'none'})")
        if video.url is not None:
            return await self.urls.fetch(video.url, index)
        if video.frames is not None:
            return tuple(video.frames)
        if len(video.data) == 0:
            raise errors.VideoDecodeError(f"video {index}: empty video data (0 bytes)")
        return video.data

    def probe(self, index: int, data: Video, video: VideoInput) -> ProbedVideo:
        """CPU thread: the header, the plan and the key of one video."""
        try:
            # The processor's options by their names (all of OPTIONS but frames_fps, which is about the frames).
            options = VideoOptions(**{f.name: getattr(video, f.name) for f in dataclasses.fields(VideoOptions)})
            plan = plan_video(probe_video(data, self.limits, frames_fps=video.frames_fps), self.cfg, options,
                              self.limits)
        except errors.EncoderServiceError as exc:
            raise exc.prefixed(f"video {index}: ") from None
        parts = [data] if isinstance(data, bytes) else data
        # The rows depend on the frames sampled and the size they are resized to (the model, its video settings
        # and the device kind are in video_fp): the same file sampled another way is another video.
        sampled = {"frames": list(plan.frame_indices), "size": [plan.resized_height, plan.resized_width]}
        if video.caller_id is not None:
            try:
                key = video_caller_key(video.caller_id, self._video_fp)
            except errors.EncoderServiceError as exc:
                raise exc.prefixed(f"video {index}: ") from None
            return ProbedVideo(key, plan, data, video_tag(parts, sampled))
        return ProbedVideo(video_key(parts, sampled, self._video_fp, self._hash), plan, data)

    def prepare(self, job: GroupJob, grid_thw: GridTHW) -> torch.Tensor:
        """CPU thread (the engine's prepare stage): the group's pixel values [h*w, patch_dim] in the tower's
        dtype on the model's device, complete."""
        if tuple(grid_thw) != job.plan.group_grid:
            raise errors.VideoDecodeError(f"frame group {job.group} has grid {job.plan.group_grid}, its job says "
                                          f"{tuple(grid_thw)}")
        frames = job.decoder.group(job.group)
        device = self._streams.device
        return self._streams.run(lambda: preprocess_group(frames, job.plan, self.cfg, device=device,
                                                          dtype=self._dtype), lambda t: t)
