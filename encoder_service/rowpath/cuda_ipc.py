"""The CUDA runtime calls both ends of the IPC fetch make (protocol/ipc.py), through ctypes on the runtime
library torch already loaded: the server's device row arena (runtime/arena_memory.py: cudaMalloc, then
cudaIpcGetMemHandle once) and a consumer opening it (client/ipc.py: cudaIpcOpenMemHandle once per arena
generation and device, cudaIpcCloseMemHandle when the server restarts).

Why not torch's own IPC (torch.multiprocessing, `storage._share_cuda_()`): it exports a block of torch's
caching allocator, whose segments cannot be exported reliably (with expandable segments they are not
cudaMalloc allocations at all), and its handles travel pickled. Here the arena is one cudaMalloc allocation
of our own, its handle 64 raw bytes (`cudaIpcMemHandle_t`), base64 in JSON.

Which library: the libcudart mapped into this process already (/proc/self/maps: the one torch uses, so the
same runtime state), else `libcudart.so.13`, else `.12` by soname. None found, or a call failing, is
`CudaIpcError`: callers fall back (one log line), never crash.
"""

from __future__ import annotations

import ctypes
import os
import threading

from encoder_service.protocol.ipc import HANDLE_BYTES

KIND = "cuda"  # the protocol's name for an arena of cudaMalloc memory (protocol/ipc.py: IpcPlacement.kind)
LAZY_ENABLE_PEER_ACCESS = 0x01  # cudaIpcMemLazyEnablePeerAccess: the consumer may sit on another GPU
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
SONAMES = ("libcudart.so.13", "libcudart.so.12")


class CudaIpcError(RuntimeError):
    """The CUDA runtime is missing here, or refused a call (its error string in the message)."""


class _Handle(ctypes.Structure):
    # Bytes, not chars: a c_char array reads back cut at its first NUL (a handle is binary).
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]  # passed by value to cudaIpcOpenMemHandle


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _mapped_cudart() -> list[str]:
    """Paths of libcudart libraries mapped into this process (the first one torch loaded)."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[-1] for line in f if "libcudart.so" in line]
    except OSError:
        return []
    return list(dict.fromkeys(p for p in paths if os.path.basename(p).startswith("libcudart.so")))


def cudart() -> ctypes.CDLL:
    """The CUDA runtime library (loaded once), with the signatures used here; CudaIpcError when none loads."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        for name in (*_mapped_cudart(), *SONAMES):
            try:
                lib = ctypes.CDLL(name)
            except OSError as exc:
                tried.append(f"{name}: {exc}")
                continue
            _declare(lib)
            _lib = lib
            return lib
        raise CudaIpcError("no CUDA runtime library (libcudart) could be loaded: " + "; ".join(tried))


def _declare(lib: ctypes.CDLL) -> None:
    vp, err = ctypes.c_void_p, ctypes.c_int
    lib.cudaMalloc.argtypes, lib.cudaMalloc.restype = [ctypes.POINTER(vp), ctypes.c_size_t], err
    lib.cudaFree.argtypes, lib.cudaFree.restype = [vp], err
    lib.cudaIpcGetMemHandle.argtypes, lib.cudaIpcGetMemHandle.restype = [ctypes.POINTER(_Handle), vp], err
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), _Handle, ctypes.c_uint]
    lib.cudaIpcOpenMemHandle.restype = err
    lib.cudaIpcCloseMemHandle.argtypes, lib.cudaIpcCloseMemHandle.restype = [vp], err
    lib.cudaMemcpyAsync.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
    lib.cudaMemcpyAsync.restype = err
    lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [err], ctypes.c_char_p
    lib.cudaGetLastError.argtypes, lib.cudaGetLastError.restype = [], err


def _check(code: int, what: str) -> None:
    if code != 0:
        # The runtime keeps the error as its last one: cleared here, or torch's next check of it (any later
        # kernel launch on this thread) raises it as its own (an AcceleratorError far from here).
        cudart().cudaGetLastError()
        text = cudart().cudaGetErrorString(code)
        raise CudaIpcError(f"{what} failed: CUDA error {code} ({text.decode(errors='replace') if text else '?'})")


# Each call below runs with the caller's device current (torch.cuda.device(...)): the runtime acts on it.
def malloc(nbytes: int) -> int:
    ptr = ctypes.c_void_p()
    _check(cudart().cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc({nbytes})")
    return int(ptr.value)


def free(ptr: int) -> None:
    _check(cudart().cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def export_handle(ptr: int) -> bytes:
    """The 64-byte IPC handle of a cudaMalloc allocation (any process on this host may open it)."""
    handle = _Handle()
    _check(cudart().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
    return bytes(handle.reserved)


def open_handle(handle: bytes) -> int:
    """Another process's allocation mapped into the current device's context (peer access enabled lazily);
    its device pointer. Refused in the exporting process itself, and where IPC is not allowed (some containers,
    MIG, sandboxed kernels)."""
    if len(handle) != HANDLE_BYTES:
        raise CudaIpcError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
    ptr = ctypes.c_void_p()
    _check(cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), _Handle.from_buffer_copy(handle), LAZY_ENABLE_PEER_ACCESS),
           "cudaIpcOpenMemHandle")
    return int(ptr.value)


def close_handle(ptr: int) -> None:
    _check(cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy of `nbytes` from device pointer `src` to `dst` on `stream` (a raw cudaStream_t): across
    GPUs too, once the source was opened with peer access. Pointers, not tensors, on the consumer's side: torch
    would place a tensor over an opened handle on the device the memory physically sits on (its pointer
    attributes), which need not be the device whose context opened it."""
    _check(cudart().cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, MEMCPY_DEFAULT,
                                    ctypes.c_void_p(stream)), "cudaMemcpyAsync")


class DeviceBytes:
    """`nbytes` bytes at device pointer `ptr`, as torch takes them: `torch.as_tensor(DeviceBytes(...),
    device=...)` is a uint8 tensor over that memory (no copy; it keeps this object, not the memory, alive)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}
