"""Bounds on what one untrusted image may cost, checked before any pixel is decoded."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LimitExceeded
from ..settings import VIDEO_CODECS, VIDEO_CONTAINERS

# smart_resize (transformers) rejects anything longer than this; a looser limit here could not be served.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int  # encoded size
    max_pixels: int  # decoded width * height, read from the header
    max_aspect_ratio: float = MAX_ASPECT_RATIO  # long side / short side

    def __post_init__(self):
        if self.max_image_bytes < 1 or self.max_pixels < 1:
            raise ValueError(f"limits must be positive: {self}")
        if not 1 <= self.max_aspect_ratio <= MAX_ASPECT_RATIO:
            raise ValueError(f"max_aspect_ratio must be in [1, {MAX_ASPECT_RATIO}], got {self.max_aspect_ratio}")

    def check_encoded_size(self, num_bytes: int) -> None:
        if num_bytes > self.max_image_bytes:
            raise LimitExceeded("encoded image size in bytes", num_bytes, self.max_image_bytes)

    def check_dimensions(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise LimitExceeded(f"decoded pixel count of the {width}x{height} image", width * height, self.max_pixels)
        check_aspect_ratio(width, height, self.max_aspect_ratio)


def check_aspect_ratio(width: int, height: int, limit: float) -> None:
    ratio = max(width, height) / min(width, height)
    if ratio > limit:
        raise LimitExceeded(f"aspect ratio (long side / short side) of the {width}x{height} image", ratio, limit)


# Demuxers we open (FFmpeg's names; a file is sniffed by its magic bytes and opened with that demuxer only, so
# FFmpeg never probes the others: hls or concat would open further URLs or files) and the codecs we decode
# (FFmpeg's codec names, as the stream's header gives them): settings.VIDEO_CONTAINERS / VIDEO_CODECS, the
# lists --video-containers and --video-codecs choose from.


@dataclass(frozen=True)
class VideoLimits:
    """Bounds on what one untrusted video (a container file, or a list of frames given as images) may cost.

    Everything but the frame count of a Matroska file without one in its header is checked from the
    header, before any frame is decoded (preprocessing/video_decode.py); the decoder then stops after the
    last frame it needs, and a stream that decodes to more frames or other sizes than its header said is
    an error. The pixel limits are of the source frames, before resizing: what decoding costs.
    """

    max_bytes: int = 256 << 20  # the file, or all frames' encoded images together
    max_duration_s: float = 600.0  # as the container says, and frames / frame rate
    max_source_frames: int = 36_000  # frames in the source (all are decoded up to the last one sampled)
    max_frame_pixels: int = 4096 * 4096  # width * height of one source frame
    max_decoded_pixels: int = 1 << 35  # source frames * width * height: the decoder's work
    max_frames: int = 768  # sampled frames: what the vision tower gets (before padding to an even count)
    max_tokens: int = 1 << 18  # merged tokens of the whole video: its rows in the cache
    decoder_threads: int = 2  # FFmpeg threads per decoder (PyAV's default, 0, would take every core)
    containers: tuple[str, ...] = VIDEO_CONTAINERS
    codecs: tuple[str, ...] = VIDEO_CODECS
    exif_orientation: bool = True  # frames given as images: each upright by its EXIF, as an image (decode.py)

    def __post_init__(self):
        counts = (self.max_bytes, self.max_source_frames, self.max_frame_pixels, self.max_decoded_pixels,
                  self.max_frames, self.max_tokens, self.decoder_threads)
        if min(counts) < 1 or not self.max_duration_s > 0:
            raise ValueError(f"limits must be positive: {self}")
        for name, allowed, known in (("containers", self.containers, VIDEO_CONTAINERS),
                                     ("codecs", self.codecs, VIDEO_CODECS)):
            if not set(allowed) <= set(known):
                raise ValueError(f"{name} must be among {known}, got {allowed}")

    def image_limits(self) -> ImageLimits:
        """What one frame given as an image may cost."""
        return ImageLimits(max_image_bytes=self.max_bytes, max_pixels=self.max_frame_pixels)
