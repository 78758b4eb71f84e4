"""Where a benchmark runs: the GPU in bfloat16, or with --small the CPU in float32."""

from __future__ import annotations

import torch


def bench_device(small: bool, parser) -> tuple[torch.device, torch.dtype]:
    """The GPU in bfloat16, or for --small the CPU in float32; a usage error when the GPU is wanted and absent."""
    if not small and not torch.cuda.is_available():
        parser.error("needs a CUDA device (use --small for a CPU smoke test)")
    return (torch.device("cpu"), torch.float32) if small else (torch.device("cuda"), torch.bfloat16)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): around anything timed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
