"""The device row arena's memory on a GPU (runtime/device_arena.py: ArenaMemory), and the arena the service
builds from its settings (`make_arena`).

`CudaArenaMemory`: ONE allocation made with cudaMalloc directly (rowpath/cuda_ipc.py), not through torch's
caching allocator (whose segments cannot be exported reliably: with expandable segments they are not cudaMalloc
allocations), exported once as an IPC handle; torch sees it as one uint8 tensor (`bytes`, no copy), so the
engine fills it with plain device-to-device copies. Freed at `close()`.

Size (`--ipc-arena-bytes`): "auto" is a quarter of the device memory free once the model is loaded and its
graphs captured (what `torch.cuda.mem_get_info` reports then), at most AUTO_CAP: room for the rows of a few
hundred recent images beside what the engine still allocates as it runs (preprocessed images, eager batches).
0 is off; so is any size on a CPU device.
"""

from __future__ import annotations

import logging

import torch

from encoder_service.rowpath import cuda_ipc
from encoder_service.runtime.device_arena import DeviceArena

log = logging.getLogger(__name__)

AUTO_FRACTION = 0.25
AUTO_CAP = 8 << 30  # 280 Qwen3-VL 720p images (28.8 MB of rows each), 120 at 1080p


class CudaArenaMemory:
    kind = cuda_ipc.KIND

    def __init__(self, device: torch.device, nbytes: int):
        self.nbytes = nbytes
        with torch.cuda.device(device):
            self._ptr = cuda_ipc.malloc(nbytes)
            try:
                self.handle = cuda_ipc.export_handle(self._ptr)
                self.bytes = torch.as_tensor(cuda_ipc.DeviceBytes(self._ptr, nbytes), device=device)
            except BaseException:
                cuda_ipc.free(self._ptr)
                raise
        self.device = self.bytes.device  # with its index ("cuda" alone never equals the outputs' "cuda:0")

    def close(self) -> None:
        if self._ptr:
            self.bytes = None
            torch.cuda.synchronize(self.device)  # no copy into it is still queued
            with torch.cuda.device(self.device):
                cuda_ipc.free(self._ptr)
            self._ptr = 0


def auto_size(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(AUTO_CAP, free * AUTO_FRACTION)) // (1 << 20) << 20  # whole MiB


def make_arena(device, arena_bytes: int | None, lease_s: float, memory=None) -> DeviceArena | None:
    """The arena of `arena_bytes` (None: auto) on `device`, or None (off: 0, a CPU device, or CUDA refusing:
    logged once). `memory(nbytes)`, when given, makes the memory instead (the CPU tests' host stand-in)."""
    device = torch.device(device)
    if arena_bytes == 0:
        log.info("device row arena: off (--ipc-arena-bytes 0): fetches by IPC are off")
        return None
    if memory is None and device.type != "cuda":
        log.info("device row arena: off on %s (CUDA only): fetches by IPC are off", device)
        return None
    try:
        nbytes = arena_bytes if arena_bytes is not None else (auto_size(device) if memory is None else 64 << 20)
        if nbytes <= 0:
            log.warning("device row arena: off: no device memory left for it on %s", device)
            return None
        arena = DeviceArena(memory(nbytes) if memory is not None else CudaArenaMemory(device, nbytes),
                            lease_s=lease_s)
    except (cuda_ipc.CudaIpcError, RuntimeError, OSError) as exc:
        log.warning("device row arena: off: %s (fetches by IPC are off; the other paths serve)", exc)
        return None
    log.info("device row arena: %.0f MiB on %s (%s), IPC generation %s, hold lease %gs", nbytes / (1 << 20),
             device, arena.memory.kind, arena.generation, lease_s)
    return arena
