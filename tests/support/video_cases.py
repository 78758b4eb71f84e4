"""Small clips the video tests make themselves with PyAV (its wheels bundle FFmpeg with encoders), and the
broken or hostile files built from them. Shared by tests/unit (decoding, limits, plans, towers) and
tests/engines/test_torchvision_video.py (bit-exact against transformers' video processors).
"""

from __future__ import annotations

import io
import struct
import tempfile
from pathlib import Path

import av
import numpy as np

from tests.support.preprocess_cases import encode, rgb_image, texture

# (container format, encoder, encoder options): one clip kind per demuxer and decoder we accept.
CLIP_KINDS = {
    "mp4_h264": ("mp4", "libx264", {"preset": "ultrafast"}),
    "mov_mpeg4": ("mov", "mpeg4", {}),
    "webm_vp9": ("webm", "libvpx-vp9", {"deadline": "realtime", "cpu-used": "8"}),
    "webm_vp8": ("webm", "libvpx", {"deadline": "realtime", "cpu-used": "8"}),
    "mkv_h264": ("matroska", "libx264", {"preset": "ultrafast"}),
    "mkv_mjpeg": ("matroska", "mjpeg", {}),
    "mp4_hevc": ("mp4", "libx265", {"preset": "ultrafast", "x265-params": "log-level=error"}),
    "mp4_av1": ("mp4", "libsvtav1", {"preset": "12"}),
}


def frame_pixels(index: int, height: int, width: int) -> np.ndarray:
    """[H, W, 3] uint8: texture (gradients and noise) that moves from frame to frame."""
    return np.roll(texture(height, width, 3, seed=index % 3), shift=3 * index, axis=1)


def make_clip(kind: str = "mp4_h264", frames: int = 7, width: int = 64, height: int = 48, fps: int = 24,
              faststart: bool = False) -> bytes:
    """A clip of `frames` synthetic frames. faststart: the MP4's index before its frames (the muxer moves it
    there in a second pass over a real file), so a cut file still opens."""
    fmt, codec, options = CLIP_KINDS[kind]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"clip.{fmt}"
        with av.open(str(path), "w", format=fmt, options={"movflags": "faststart"} if faststart else {}) as container:
            stream = container.add_stream(codec, rate=fps, options=options)
            stream.width, stream.height = width, height
            stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
            for i in range(frames):
                frame = av.VideoFrame.from_ndarray(frame_pixels(i, height, width), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        return path.read_bytes()


def audio_only_mp4() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        samples = np.zeros((1, 1024 * 4), np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = 16000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def mkv_without_frames() -> bytes:
    """A Matroska file whose video stream has no frames."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()  # the header: PyAV writes it with the first packet otherwise
    return buffer.getvalue()


def mp4_claiming_frames(count: int, **clip_args) -> bytes:
    """An MP4 clip whose header (its stts box: frame count and duration) claims `count` frames."""
    data = bytearray(make_clip("mp4_h264", **clip_args))
    stts = data.find(b"stts")
    entries, sample_count = struct.unpack(">II", data[stts + 8 : stts + 16])
    assert entries == 1, "the clip's stts has one run of frames"
    data[stts + 12 : stts + 16] = struct.pack(">I", count)
    return bytes(data)


def mjpeg_claiming_size(height: int, width: int) -> bytes:
    """An MKV of MJPEG frames whose JPEG headers claim height x width (the container says 64x48)."""
    data = bytearray(make_clip("mkv_mjpeg", frames=3))
    start = 0
    while (start := data.find(b"\xff\xc0", start)) >= 0:  # SOF0: length (2), precision (1), height, width
        if struct.unpack(">HH", data[start + 5 : start + 9]) == (48, 64):
            data[start + 5 : start + 9] = struct.pack(">HH", height, width)
        start += 2
    return bytes(data)


def frame_images(count: int, height: int = 48, width: int = 64, fmt: str = "PNG") -> list[bytes]:
    """A video as a list of frames, each an image file."""
    return [encode(rgb_image(height, width, seed=i), fmt) for i in range(count)]
