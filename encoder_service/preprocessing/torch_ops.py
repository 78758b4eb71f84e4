"""transformers' torchvision-backend processors (`Qwen2VLImageProcessor`; the video processors
`Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor`, frame group by frame group) as plain torch ops, on any
device.

Each function makes the torch calls that torchvision and transformers 5.x end up making, in the same order
and dtypes, so on the same device the result is theirs bit for bit (CPU: tests/torchvision; CUDA:
tests/gpu/test_preprocess_cuda.py). No torchvision import: the service runs this without torchvision.

  resize     torchvision.transforms.v2.functional.resize_image(BICUBIC, antialias=True)
  normalize  TorchvisionBackend.rescale_and_normalize with do_rescale and do_normalize (fused)
  patchify   Qwen2VLImageProcessor.patchify (merge-block order, the frame repeated over T); the video
             processors' patchify, one frame group (T frames) at a time

The result depends on the device, by design of torchvision: on the CPU it resizes uint8 natively, elsewhere
it goes through float32. The two differ by a level or more on many pixels, so each device is only ever
compared with transformers run on that same kind of device.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from .config import PreprocessConfig


def resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[..., 3, H, W] uint8 (an image, or a video's frames) -> [..., 3, height, width] uint8, bicubic with
    antialiasing, as torchvision resizes (frame by frame: one interpolate over all of them, as it does).

    Same size: the input itself (torchvision does not interpolate then). CPU: torch's native uint8 kernel
    (int16 fixed-point weights), which torchvision picks for bicubic on the CPU whatever the SIMD level.
    Any other device: float32 interpolate, clamp to 0..255, round half to even, cast back.
    """
    if tuple(image.shape[-2:]) == (height, width):
        return image
    batch = image.reshape(-1, *image.shape[-3:])  # interpolate wants [N, C, H, W]
    if image.device.type == "cpu":
        out = F.interpolate(batch, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    else:
        out = F.interpolate(batch.to(torch.float32), size=[height, width], mode="bicubic", align_corners=False,
                            antialias=True)
        out = out.clamp_(min=0, max=255).round_().to(torch.uint8)
    return out.reshape(*image.shape[:-2], height, width)


def normalize(image: torch.Tensor, cfg: PreprocessConfig) -> torch.Tensor:
    """[..., 3, H, W] uint8 -> float32 of that shape: (x - 255 * mean) / (255 * std), one subtraction and one
    division in float32, as transformers fuses rescale and normalize (not the PIL path's
    ((x / 255) - mean) / std, which rounds differently in the last bit)."""
    mean, std = _scaled_mean_std(cfg.image_mean, cfg.image_std, cfg.rescale_factor, image.device)
    return image.to(torch.float32).sub_(mean).div_(std)


def patchify(frames: torch.Tensor, cfg: PreprocessConfig) -> torch.Tensor:
    """An image [C, H, W] (the frame repeated over T) or a video's frame group [T, C, H, W] (T =
    temporal_patch_size consecutive frames), H and W multiples of cfg.factor -> [N, C*T*P*P],
    N = (H/P)*(W/P), in merge-block order (the m*m patches of one merged token are consecutive rows), each
    row a (C, T, P, P) block. Contiguous, same dtype as the input; the layout of the PIL path (patchify.py)
    and, group after group, of transformers' video processors' patchify (t-major)."""
    if frames.dim() == 3:
        frames = frames.unsqueeze(0).expand(cfg.temporal_patch_size, -1, -1, -1)  # a view: no copy yet
    t, channels, height, width = frames.shape
    p, m = cfg.patch_size, cfg.merge_size
    grid_h, grid_w = height // p, width // p
    # pixel row = (merged row, m, p), column = (merged col, m, p)
    blocks = frames.reshape(t, channels, grid_h // m, m, p, grid_w // m, m, p)
    blocks = blocks.permute(2, 5, 3, 6, 1, 0, 4, 7)  # [H/(pm), W/(pm), m, m, C, T, P, P]
    return blocks.reshape(grid_h * grid_w, channels * t * p * p)  # the one copy


def to_pixel_values(image: torch.Tensor, height: int, width: int, cfg: PreprocessConfig,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[3, H, W] uint8 RGB (or a frame group, [T, 3, H, W]) -> pixel_values [N, C*T*P*P] in `dtype`, on the
    image's device.

    Casting before patchify gives the same values as after it (a cast is per element, patchify only moves
    and repeats elements) and moves half the bytes for bf16.
    """
    return patchify(normalize(resize(image, height, width), cfg).to(dtype), cfg)


@lru_cache(maxsize=16)
def _scaled_mean_std(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, 1, 1] float32 255*mean and 255*std on `device`, as transformers computes them: float32 tensors
    times the Python float 1/rescale_factor. Computed on the CPU (a float32 product rounds the same on any
    IEEE device) and copied with a blocking copy, so the cached tensors are complete before any stream
    reads them; nothing ever writes into them."""
    scale = 1.0 / rescale_factor
    return tuple((torch.tensor(values, dtype=torch.float32) * scale).view(-1, 1, 1).to(device)
                 for values in (mean, std))
