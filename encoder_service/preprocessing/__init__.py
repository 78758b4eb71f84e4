"""Image preprocessing for the Qwen-VL vision towers, equal to transformers' PIL-backend processor.

`probe` and `plan` size an image from its header alone (so `encode` can answer before decoding);
`preprocess` produces the tower's input. See docs/interfaces.md, Preprocessing.
"""

from .config import PreprocessConfig
from .decode import SUPPORTED_FORMATS, ImageHeader, probe
from .limits import ImageLimits
from .pipeline import PreprocessedImage, preprocess
from .resize import ImagePlan, plan

__all__ = [
    "SUPPORTED_FORMATS",
    "ImageHeader",
    "ImageLimits",
    "ImagePlan",
    "PreprocessConfig",
    "PreprocessedImage",
    "plan",
    "preprocess",
    "probe",
]
