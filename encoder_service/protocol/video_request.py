"""What a request asks of one video, on both ends: its source, an optional caller id, and transformers' video
processor options. The client sends a `VideoRequest` (client/types.py: VideoSource), the core takes one
(core/types.py: VideoInput); `OPTIONS` names and types the options as every transport carries them: HTTP JSON
fields and query parameters (api/video_bodies.py), gRPC `Video` fields (proto/encoder.proto). What they mean
is preprocessing/video.py's VideoOptions."""

from __future__ import annotations

from dataclasses import dataclass

# Option -> the type of its value. Every place that names the options again agrees with this table (their
# names, order and types: tests/unit/test_video_options.py): VideoRequest below, the HTTP JSON's VideoJson, the
# proto's Video, preprocessing/video.py's VideoOptions (all but frames_fps, the rate of given frames).
OPTIONS: dict[str, type] = {"fps": float, "num_frames": int, "sample_frames": bool, "min_pixels": int,
                            "max_pixels": int, "frames_fps": float}


@dataclass(frozen=True)
class VideoRequest:
    """Exactly one of `data` (a container file's bytes: MP4, MOV, MKV, WebM), `frames` (each an image file's
    bytes, in order) or `url` (of a container file); the core checks that. `caller_id`: an optional
    caller-supplied id (the video namespace, "v:u:<id>"). The options are None where the checkpoint's
    processor settings hold; `frames_fps` is the rate of `frames` (None: unknown)."""

    data: bytes | None = None
    frames: tuple[bytes, ...] | None = None
    url: str | None = None
    caller_id: str | None = None
    fps: float | None = None
    num_frames: int | None = None
    sample_frames: bool | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    frames_fps: float | None = None

    def options(self) -> dict:
        """The options that are set, by name."""
        return {name: getattr(self, name) for name in OPTIONS if getattr(self, name) is not None}
