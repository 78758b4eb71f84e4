"""The service a benchmark measures: its settings, and the service itself (core + HTTP, optionally gRPC, on
127.0.0.1) running on its own thread's event loop in this process."""

from __future__ import annotations

from pathlib import Path

import torch


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
