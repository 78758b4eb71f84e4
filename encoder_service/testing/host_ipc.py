"""A HOST-MEMORY STAND-IN for the device row arena's CUDA memory and its consumer, for tests and the benchmarks'
CPU smoke runs only: no server or client picks it on its own (build_core(..., ipc_memory=...) and
EncoderClient.http(..., ipc=HostStandInReader(...)) name it).

It lets the CPU tests run everything the GPU path runs but the CUDA calls: the arena's allocator and holds
(runtime/device_arena.py), the fetch by IPC over real HTTP (core/ipc_fetch.py, protocol/ipc.py), the client's
copy, lease check, acknowledgements and fallbacks (client/ipc.py), across processes too: the "device memory"
is a file in `directory` mapped MAP_SHARED (name `encoder-ipc-standin-<16 hex>`), its "IPC handle" that name
(zero-padded to the 64 bytes of a CUDA handle), and its "opening" a map of the same file.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading

import torch

KIND = "host-standin"
HANDLE_BYTES = 64
PREFIX = "encoder-ipc-standin-"


class HostStandInMemory:
    """Stands in for runtime/arena_memory.py: CudaArenaMemory (ArenaMemory) on the CPU."""

    kind = KIND
    device = torch.device("cpu")

    def __init__(self, nbytes: int, directory: str = "/dev/shm"):
        self.nbytes = nbytes
        name = PREFIX + secrets.token_hex(8)
        self._path = os.path.join(directory, name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.handle = name.encode().ljust(HANDLE_BYTES, b"\0")
        self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    @classmethod
    def factory(cls, directory: str):
        """`memory(nbytes)` for build_core(..., ipc_memory=...) with files in `directory`."""
        return lambda nbytes: cls(nbytes, directory)

    def close(self) -> None:
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


class HostStandInReader:
    """Stands in for client/ipc.py: CudaIpcReader, for CPU `out` tensors. `refuse`: every open fails, as a
    CUDA IPC open does where it is not allowed (a test of the fallback)."""

    kind = KIND

    def __init__(self, directory: str = "/dev/shm", refuse: bool = False):
        self.directory, self.refuse = directory, refuse
        self._maps: dict[str, torch.Tensor] = {}  # generation -> the arena's bytes (one per server process)
        self._lock = threading.Lock()
        self.opened = 0  # opens so far (one per generation)

    def accepts(self, out: torch.Tensor) -> bool:
        return out.device.type == "cpu"

    def copy(self, handle: bytes, generation: str, pieces: list[tuple[int, int, torch.Tensor]]) -> None:
        arena = self._arena(handle, generation)
        for offset, nbytes, dst in pieces:
            if offset + nbytes > arena.numel():
                raise OSError(f"bytes [{offset}, {offset + nbytes}) outside the {arena.numel()}-byte stand-in arena")
            dst.view(-1).view(torch.uint8).copy_(arena[offset:offset + nbytes])

    def _arena(self, handle: bytes, generation: str) -> torch.Tensor:
        with self._lock:
            if generation not in self._maps:
                if self.refuse:
                    raise OSError("the host stand-in refuses to open IPC handles (refuse=True)")
                name = handle.rstrip(b"\0").decode()
                if not name.startswith(PREFIX) or "/" in name:
                    raise OSError(f"not a host stand-in handle: {handle[:24]!r}")
                with open(os.path.join(self.directory, name), "r+b") as f:
                    mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
                self._maps[generation] = torch.frombuffer(mm, dtype=torch.uint8)
                self.opened += 1
            return self._maps[generation]

    def synchronize(self, device: torch.device) -> None:
        pass  # CPU copies are done when copy_ returns

    def forget(self, generation: str) -> None:
        with self._lock:
            self._maps.pop(generation, None)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
