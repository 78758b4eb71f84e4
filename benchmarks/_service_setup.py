"""Shared setup of the end-to-end benchmarks (scenarios.py, load_bench.py, connector_bench.py): a real-size
random-weight checkpoint the service loads, photo-like JPEGs, the device, the service's settings, and the service
(core + HTTP, optionally gRPC, on 127.0.0.1) running on its own thread's event loop in this process.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# Preprocessing of the released checkpoints (their preprocessor_config.json); --small keeps images at most 256
# tokens.
PREPROCESS = {
    "qwen2_5_vl": dict(min_pixels=3136, max_pixels=12845056, image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711]),
    "qwen3_vl": dict(min_pixels=65536, max_pixels=16777216, image_mean=[0.5] * 3, image_std=[0.5] * 3),
}


def build_checkpoint(family: str, small: bool, device: torch.device, dtype: torch.dtype, directory: Path) -> None:
    """Random-weight vision tower of the real (or --small) size, saved as a checkpoint the service loads."""
    from gpu_parity import REAL, SMALL, build_reference  # transformers: imported only when needed

    vision = (SMALL if small else REAL)[family]
    model = build_reference(family, vision, device, dtype, directory)
    del model  # the service loads its own copy; free this one before measuring memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    pre = dict(PREPROCESS[family], patch_size=vision["patch_size"], temporal_patch_size=2, merge_size=2,
               image_processor_type="Qwen2VLImageProcessor", do_resize=True, do_rescale=True,
               rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)
    if small:
        pre.update(min_pixels=4 * (2 * vision["patch_size"]) ** 2, max_pixels=256 * (2 * vision["patch_size"]) ** 2)
    (directory / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """[height, width, 3] uint8, photo-like (gradients + noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 6.28, 3)
    base = np.stack([127 + 100 * np.sin(x / (37 + 13 * c) + y / (53 + 7 * c) + phase[c]) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def jpeg(width: int, height: int, seed: int, comment: str = "") -> bytes:
    """A photo-like JPEG (gradients + noise). `comment` changes the bytes (and so the cache key), not the
    pixels."""
    buf = io.BytesIO()
    Image.fromarray(photo(width, height, seed), "RGB").save(buf, format="JPEG", quality=92, comment=comment.encode())
    return buf.getvalue()


def bench_device(small: bool, parser) -> tuple[torch.device, torch.dtype]:
    """The GPU in bfloat16, or for --small the CPU in float32; a usage error when the GPU is wanted and absent."""
    if not small and not torch.cuda.is_available():
        parser.error("needs a CUDA device (use --small for a CPU smoke test)")
    return (torch.device("cpu"), torch.float32) if small else (torch.device("cuda"), torch.bfloat16)


def service_settings(checkpoint: Path, device: torch.device, dtype: torch.dtype, http_sock, *extra: str,
                     grpc: bool = True):
    """Settings of a benchmark's service: the checkpoint on `device` in `dtype`, HTTP on `http_sock`'s port,
    gRPC on a free port (or off), on 127.0.0.1, warnings only; `extra` flags after those."""
    from encoder_service.settings import Settings
    from tests.support.ports import free_port

    return Settings.from_args([
        "--model", str(checkpoint), "--device", device.type, "--dtype", str(dtype).removeprefix("torch."),
        "--host", "127.0.0.1", "--http-port", str(http_sock.getsockname()[1]),
        "--grpc-port", str(free_port()) if grpc else "0", "--log-level", "warning", *extra], env={})


def in_process_service(settings, http_sock, core=None):
    """The service (core + HTTP on `http_sock`, gRPC too when the settings give it a port) on its own thread's
    event loop in this process (tests/support/service.py: RunningService). `core`: an already built
    EncoderCore (api/service.py: build_core) to serve. `.url`, `.grpc_address`, `.close()`."""
    from tests.support.service import RunningService

    return RunningService(settings, http_sock=http_sock, core=core, start_timeout_s=1800)  # CUDA graph capture


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
