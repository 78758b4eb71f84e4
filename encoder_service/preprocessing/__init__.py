"""Image preprocessing for the Qwen-VL vision towers, equal to transformers' processors.

`probe` and `plan` size an image from its header alone (so `encode` can answer before decoding); a backend
(`make_backend`: pil or torchvision, backends.py) produces the tower's input; `preprocess` is the pil one.
Videos: `probe_video` and `plan_video` answer from the header; `iter_frame_groups` decodes and
`preprocess_group` prepares one frame group at a time (video.py, video_decode.py).
See docs/interfaces.md, Preprocessing.
"""

from .backends import Backend, PilBackend, TorchvisionBackend, make_backend
from .config import PreprocessConfig
from .decode import SUPPORTED_FORMATS, ImageHeader, probe
from .limits import ImageLimits, VideoLimits
from .pipeline import PreprocessedImage, preprocess
from .resize import ImagePlan, plan
from .video import VideoOptions, VideoPlan, VideoProbe, plan_video, preprocess_group, timestamp_text
from .video_config import VideoConfig
from .video_decode import iter_frame_groups, probe_video

__all__ = [
    "SUPPORTED_FORMATS",
    "Backend",
    "ImageHeader",
    "ImageLimits",
    "ImagePlan",
    "PilBackend",
    "PreprocessConfig",
    "PreprocessedImage",
    "TorchvisionBackend",
    "VideoConfig",
    "VideoLimits",
    "VideoOptions",
    "VideoPlan",
    "VideoProbe",
    "iter_frame_groups",
    "make_backend",
    "plan",
    "plan_video",
    "preprocess",
    "preprocess_group",
    "probe",
    "probe_video",
    "timestamp_text",
]
