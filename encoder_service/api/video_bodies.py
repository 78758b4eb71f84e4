"""Videos in HTTP encode requests (api/http.py), each body kind into the core's `VideoInput`s:

  JSON       {"videos": [{"data": b64 | "frames": [b64, ...] | "url": ..., "id"?, "fps"?, "num_frames"?,
                         "sample_frames"?, "min_pixels"?, "max_pixels"?, "frames_fps"?}], "wait", ...}
  multipart  a `video` field per video file; `frame` fields, in order, are one video given as its frames
  binary     one video file: content-type video/* (or application/octet-stream with ?video=true)
For multipart and binary bodies the options are query parameters (`fps`, `num_frames`, `sample_frames`,
`min_pixels`, `max_pixels`, `frames_fps`; `id` for a binary body, or a multipart body of one video), the same
for every video of the request (which options each body takes: api/query_options.py).
A bad value is InvalidInput naming the parameter; what the options mean is preprocessing/video.py's
VideoOptions (transformers' video processor's own).
"""

from __future__ import annotations

from encoder_service.api import bodies
from encoder_service.core.types import VideoInput
from encoder_service.errors import InvalidInput
from encoder_service.protocol.video_request import OPTIONS


def json_video(index: int, video) -> VideoInput:
    """One entry of a JSON body's "videos" (api/http.py: VideoJson; the core checks that exactly one source is
    given)."""
    data = None if video.data is None else bodies.b64(f"video {index}: data", video.data)
    frames = None if video.frames is None else tuple(bodies.b64(f"video {index}: frames[{k}]", f)
                                                     for k, f in enumerate(video.frames))
    return VideoInput(data=data, frames=frames, url=video.url, caller_id=video.id,
                      **{name: getattr(video, name) for name in OPTIONS})


def query_options(q) -> dict:
    """The video options of a multipart or binary body, from the query string."""
    options = {}
    for name, kind in OPTIONS.items():
        text = q.get(name)
        if text is None:
            continue
        try:
            options[name] = _bool(text) if kind is bool else kind(text)
        except ValueError:
            wanted = "true or false" if kind is bool else f"a number ({kind.__name__})"
            raise InvalidInput(f"query parameter {name} must be {wanted}, got {text!r:.40}") from None
    return options


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise ValueError(text)
