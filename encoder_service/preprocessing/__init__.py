"""Image preprocessing for the Qwen-VL vision towers, equal to transformers' processors.

`probe` and `plan` size an image from its header alone (so `encode` can answer before decoding); a backend
(`make_backend`: pil or torchvision, backends.py) produces the tower's input; `preprocess` is the pil one.
See docs/interfaces.md, Preprocessing.
"""

from .backends import Backend, PilBackend, TorchvisionBackend, make_backend
from .config import PreprocessConfig
from .decode import SUPPORTED_FORMATS, ImageHeader, probe
from .limits import ImageLimits
from .pipeline import PreprocessedImage, preprocess
from .resize import ImagePlan, plan

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
    "make_backend",
    "plan",
    "preprocess",
    "probe",
]
