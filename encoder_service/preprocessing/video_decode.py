"""Untrusted video -> frames, header first and bounded, with PyAV (FFmpeg's libraries, bundled in its wheels).

A video is a container file (bytes) or a list of frames, each an image file (a list of bytes).

  probe_video(video, limits)              -> VideoProbe: size, frame count, frame rate; every limit checked
  iter_frame_groups(video, plan, limits)  -> one [T, H, W, 3] uint8 RGB array per frame group, in order

Container files: the first bytes pick the demuxer (ISO BMFF -> FFmpeg's mov: MP4, MOV; EBML -> matroska:
MKV, WebM) and FFmpeg opens the file with that one only, so it never probes the others (hls or concat would
open other files or URLs). Opening already decodes a frame or two to fill in the stream's parameters (FFmpeg's
avformat_find_stream_info): the decoders get `max_pixels` (our per-frame limit) and one thread there too, so
even that is bounded before our own checks of the header: container and codec allow-lists, frame size,
duration, frame count, decoded pixels. The frame count is the header's (MP4) or, where the header has none
(Matroska), the stream's packets counted without decoding. Decoding runs from the start with
`decoder_threads` FFmpeg threads, converts only the sampled frames to RGB, and stops after the last one
sampled; a frame of another size than the header's, or a stream that ends early, is an error.

Frames and metadata are those of transformers' PyAV reader (video_utils.read_video_pyav): `stream.frames`
frames (where the header has them), `stream.average_rate` fps, each frame `frame.to_ndarray(format="rgb24")`.
Frames given as images are decoded by Pillow as images are (decode.decode_rgb: their EXIF orientation applied
unless `limits.exif_orientation` is False), and sized upright from their headers.

Every failure is a VideoDecodeError or LimitExceeded (an ImageDecodeError for a frame given as an image)
naming what is wrong. A generator from iter_frame_groups holds the open file until it is exhausted or closed.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator, Sequence

import av
import numpy as np

from ..errors import EncoderServiceError, LimitExceeded, VideoDecodeError
from .decode import decode_rgb, probe
from .limits import VideoLimits
from .video import FRAMES, VideoPlan, VideoProbe

VideoInput = bytes | Sequence[bytes]

# ISO BMFF files start with a box: 4 bytes of size, then its type. Files written by cameras and old QuickTime
# may open with a box other than ftyp.
_ISO_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")
_EBML_MAGIC = b"\x1aE\xdf\xa3"


def probe_video(video: VideoInput, limits: VideoLimits, *, frames_fps: float | None = None) -> VideoProbe:
    """The header of a container file, or of each frame of a list (whose rate, `frames_fps`, only the caller
    knows; None: unknown), with every limit checked; no frame is decoded (but see the module's docstring)."""
    if _is_container(video):
        if frames_fps is not None:
            raise VideoDecodeError("frames_fps is for a list of frames: a video file gives its own frame rate")
        container, stream, name = _open(bytes(video), limits)
        try:
            return _probe_stream(container, stream, name, limits)
        finally:
            container.close()
    return _probe_frames(video, limits, frames_fps)


def iter_frame_groups(video: VideoInput, plan: VideoPlan, limits: VideoLimits) -> Iterator[np.ndarray]:
    """The frames of each frame group of `plan` (made from this video's probe), in order: [T, H, W, 3] uint8
    RGB, a new array per group (the previous one may be kept). Decodes lazily: a group is decoded when asked
    for, so one group's frames are held at a time."""
    if _is_container(video):
        return _container_groups(bytes(video), plan, limits)
    return _image_groups(video, plan, limits)


def _is_container(video: VideoInput) -> bool:
    return isinstance(video, (bytes, bytearray, memoryview))


# ---- container files --------------------------------------------------------------------------------


def _sniff(data: bytes) -> tuple[str, str]:
    """(FFmpeg demuxer, the file's kind for messages) from the first bytes."""
    if len(data) >= 12 and data[4:8] in _ISO_BOXES:
        return "mov", "mov" if data[8:12] == b"qt  " else "mp4"
    if data[:4] == _EBML_MAGIC:
        return "matroska", "webm" if b"webm" in data[:64] else "mkv"
    raise VideoDecodeError(f"not a video file in a supported container (MP4, MOV, MKV, WebM): {len(data)} bytes"
                           + (f" starting {data[:12].hex()}" if data else ""))


def _open(data: bytes, limits: VideoLimits):
    """(container, its first video stream, the file's kind), the header's limits not yet checked."""
    if len(data) > limits.max_bytes:
        raise LimitExceeded("encoded video size in bytes", len(data), limits.max_bytes)
    demuxer, name = _sniff(data)
    if demuxer not in limits.containers:
        raise VideoDecodeError(f"{name} videos are not accepted here (accepted: {', '.join(limits.containers)})")
    # Both go to the decoders FFmpeg opens while reading the header (and, unused, to the demuxer).
    options = {"max_pixels": str(limits.max_frame_pixels), "threads": "1"}
    try:
        container = av.open(io.BytesIO(data), format=demuxer, options=options)
    except av.error.EOFError:
        raise VideoDecodeError(f"the {name} file ({len(data)} bytes) ends before its first frame") from None
    except Exception as exc:  # FFmpegError (InvalidDataError, ...), or anything PyAV raises on a broken file
        raise VideoDecodeError(f"cannot read the {name} file ({len(data)} bytes): {exc}") from None
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        container.close()
        raise VideoDecodeError(f"the {name} file has no video stream (streams: {', '.join(kinds)})")
    return container, container.streams.video[0], name


def _probe_stream(container, stream, name: str, limits: VideoLimits) -> VideoProbe:
    context = stream.codec_context
    if context is None:
        raise VideoDecodeError(f"the {name} file's video stream has a codec FFmpeg cannot decode")
    codec = context.codec.canonical_name
    if codec not in limits.codecs:
        raise VideoDecodeError(f"{codec} video is not accepted here (accepted: {', '.join(limits.codecs)})")
    width, height = context.width, context.height
    if width < 1 or height < 1:
        raise VideoDecodeError(f"the {name} file's {codec} stream has no frame size ({width}x{height})")
    if width * height > limits.max_frame_pixels:
        raise LimitExceeded(f"pixel count of the video's {width}x{height} frames", width * height,
                            limits.max_frame_pixels)
    rate = stream.average_rate
    fps = float(rate) if rate is not None and rate > 0 else None
    declared_s = container.duration / av.time_base if container.duration is not None else None
    _check_duration(declared_s, limits)  # before counting frames: a Matroska file's count reads it all
    total = stream.frames if stream.frames > 0 else _count_packets(container, stream, limits)
    if total < 1:
        raise VideoDecodeError(f"the {name} file's video stream has no frames")
    if total > limits.max_source_frames:
        raise LimitExceeded("frame count of the video", total, limits.max_source_frames)
    duration_s = total / fps if fps is not None else declared_s
    _check_duration(duration_s, limits)
    if total * width * height > limits.max_decoded_pixels:
        raise LimitExceeded(f"decoded pixel count of the video ({total} frames of {width}x{height})",
                            total * width * height, limits.max_decoded_pixels)
    return VideoProbe(width, height, total, fps, duration_s, name, codec)


def _check_duration(seconds: float | None, limits: VideoLimits) -> None:
    if seconds is not None and not seconds <= limits.max_duration_s:  # NaN too
        raise LimitExceeded("duration of the video in seconds", round(seconds, 3), limits.max_duration_s)


def _count_packets(container, stream, limits: VideoLimits) -> int:
    """The stream's frames, by demuxing its packets (no decoding): a packet is a frame in Matroska."""
    count = 0
    try:
        for packet in container.demux(stream):
            if packet.size:  # the last packet PyAV yields is an empty flush packet
                count += 1
                if count > limits.max_source_frames:
                    raise LimitExceeded("frame count of the video", f"over {limits.max_source_frames}",
                                        limits.max_source_frames)
    except EncoderServiceError:
        raise
    except Exception as exc:
        raise VideoDecodeError(f"cannot read the video's packets after {count}: {exc}") from None
    return count


def _container_groups(data: bytes, plan: VideoPlan, limits: VideoLimits) -> Iterator[np.ndarray]:
    container, stream, name = _open(data, limits)
    try:
        context = stream.codec_context
        if context is None or (context.height, context.width) != plan.source_size:
            raise VideoDecodeError(f"the {name} file's header changed since it was probed")
        context.thread_count = limits.decoder_threads
        context.thread_type = "AUTO"  # frame and slice threads; FFmpeg's threaded decoding is bit-exact
        context.options = {"max_pixels": str(limits.max_frame_pixels)}
        frames = _decoded(container, stream, name, plan)

        def rgb_of(wanted: int) -> np.ndarray:
            for index, frame in frames:  # _decoded raises if the stream ends before frames_to_decode
                if index == wanted:
                    return frame.to_ndarray(format="rgb24", threads=1)  # [H, W, 3] uint8, as transformers' reader

        yield from _groups(plan, rgb_of)
    finally:
        container.close()


def _decoded(container, stream, name: str, plan: VideoPlan) -> Iterator[tuple[int, object]]:
    """(index, frame) of the first plan.frames_to_decode frames, each checked against the header's size."""
    height, width = plan.source_size
    index = 0
    try:
        for frame in container.decode(stream):
            if (frame.height, frame.width) != (height, width):
                raise VideoDecodeError(f"frame {index} of the {name} video is {frame.width}x{frame.height}, its "
                                       f"header says {width}x{height}")
            yield index, frame
            index += 1
            if index == plan.frames_to_decode:
                return
    except EncoderServiceError:
        raise
    except Exception as exc:  # FFmpegError, or a PyAV error on a broken stream
        raise VideoDecodeError(f"cannot decode frame {index} of the {name} video: {exc}") from None
    raise VideoDecodeError(f"the {name} video ended after {index} frames, but frame {plan.frames_to_decode - 1} "
                           f"was sampled (its header says {plan.total_frames} frames): truncated or corrupt")


def _groups(plan: VideoPlan, rgb_of: Callable[[int], np.ndarray]) -> Iterator[np.ndarray]:
    """One [T, H, W, 3] array per frame group, filled with rgb_of(index) of its frames: called once per
    distinct sampled frame, in increasing order (a repeated frame is copied, not decoded again)."""
    t = plan.temporal_patch_size
    index, rgb, group = -1, None, None
    for k, wanted in enumerate(plan.padded_indices):
        if wanted != index:
            index, rgb = wanted, rgb_of(wanted)
        if k % t == 0:
            group = np.empty((t, *plan.source_size, 3), np.uint8)
        group[k % t] = rgb
        if k % t == t - 1:
            yield group


# ---- frames given as images -------------------------------------------------------------------------


def _probe_frames(frames: Sequence[bytes], limits: VideoLimits, fps: float | None) -> VideoProbe:
    if not isinstance(frames, Sequence) or isinstance(frames, str):
        raise VideoDecodeError(f"a video is a file's bytes or a list of frames, not {type(frames).__name__}")
    if not frames:
        raise VideoDecodeError("the video has no frames (an empty list)")
    if len(frames) > limits.max_source_frames:
        raise LimitExceeded("frame count of the video", len(frames), limits.max_source_frames)
    if fps is not None and not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise VideoDecodeError(f"frames_fps must be a positive number, got {fps!r}")
    total_bytes = sum(len(frame) for frame in frames)
    if total_bytes > limits.max_bytes:
        raise LimitExceeded("encoded size in bytes of the video's frames", total_bytes, limits.max_bytes)
    image_limits = limits.image_limits()
    headers = []
    for i, frame in enumerate(frames):
        try:
            headers.append(probe(frame, image_limits, exif_orientation=limits.exif_orientation))
        except EncoderServiceError as exc:
            raise exc.prefixed(f"frame {i}: ") from None
        if (headers[i].width, headers[i].height) != (headers[0].width, headers[0].height):
            raise VideoDecodeError(f"frame {i} is {headers[i].width}x{headers[i].height}, frame 0 is "
                                   f"{headers[0].width}x{headers[0].height}: a video's frames share one size")
    width, height = headers[0].width, headers[0].height
    if len(frames) * width * height > limits.max_decoded_pixels:
        raise LimitExceeded(f"decoded pixel count of the video ({len(frames)} frames of {width}x{height})",
                            len(frames) * width * height, limits.max_decoded_pixels)
    formats = "+".join(sorted({header.format for header in headers}))
    duration_s = len(frames) / fps if fps is not None else None
    return VideoProbe(width, height, len(frames), None if fps is None else float(fps), duration_s, FRAMES, formats)


def _image_groups(frames: Sequence[bytes], plan: VideoPlan, limits: VideoLimits) -> Iterator[np.ndarray]:
    image_limits = limits.image_limits()

    def rgb_of(index: int) -> np.ndarray:
        try:
            header, image = decode_rgb(frames[index], image_limits, exif_orientation=limits.exif_orientation)
        except EncoderServiceError as exc:
            raise exc.prefixed(f"frame {index}: ") from None
        if (header.height, header.width) != plan.source_size:
            raise VideoDecodeError(f"frame {index} is {header.width}x{header.height}, the video's frames are "
                                   f"{plan.source_size[1]}x{plan.source_size[0]}")
        return np.asarray(image)  # [H, W, 3] uint8

    return _groups(plan, rgb_of)
