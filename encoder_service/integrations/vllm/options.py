"""The connector's options: vLLM's `ec_connector_extra_config` (and the benchmark's knobs), parsed and checked
once (`ec_transfer_config` in __init__.py checks them before vLLM starts)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping
from urllib.parse import urlsplit

from encoder_service.protocol.shm import DEFAULT_DIR
from encoder_service.settings import parse_bool, parse_size

SHM_MODES = ("auto", "on", "off")
IPC_MODES = ("auto", "off")


@dataclass(frozen=True)
class ConnectorOptions:
    """`ec_connector_extra_config` of the vLLM connector (and the benchmark's knobs). Only `url` is required.

    url: `http://host:port` (HTTP) or `grpc://host:port` (gRPC) of the encoder service.
    auth_token: the encoder's --auth-token, if it has one.
    shm: "auto" (shared memory when the encoder runs --shm-fetch and `url` names this host), "on", "off".
    shm_dir: the encoder's --shm-dir (both sides must see the same directory); also where the staged rows
        live in socket mode.
    ipc: "auto" (rows GPU to GPU, ipc_loads.py: when the encoder has a device row arena on this host, `url` is
        HTTP and vLLM's workers are on CUDA; an item whose rows are not in the encoder's arena goes the `shm`
        way) or "off".
    ipc_channel: "auto" (a fetch by IPC goes over the encoder's same-host channel, a Unix socket, when it has
        one: client/ipc_channel.py) or "off" (over HTTP).
    max_staged_bytes: bound on rows fetched ahead of need and not yet taken by vLLM (sizes: "1GiB", ...).
    arena_bytes: size of one staging file (rows of many items; an item larger than this gets its own).
    fetch_threads: fetches in flight at once.
    fetch_timeout_s: one fetch (it waits for the encoder's ViT when the image is still being encoded).
    wait_timeout_s: how long a request may wait for its items before it is failed.
    release_on_finish: end the encoder's pins (`release`) of a request's items when vLLM finishes it (one
        release per distinct id, matching the one pin per id that the proxy's encode took).
    """

    url: str
    auth_token: str | None = field(default=None, repr=False)
    shm: str = "auto"
    shm_dir: str = DEFAULT_DIR
    ipc: str = "auto"
    ipc_channel: str = "auto"
    max_staged_bytes: int = 1 << 30
    arena_bytes: int = 128 << 20
    fetch_threads: int = 4
    fetch_timeout_s: float = 60.0
    wait_timeout_s: float = 120.0
    release_on_finish: bool = True

    def __post_init__(self):
        scheme = urlsplit(self.url).scheme
        if scheme not in ("http", "https", "grpc") or not urlsplit(self.url).netloc:
            raise ValueError(f"url must be http://host:port or grpc://host:port, got {self.url!r}")
        if self.shm not in SHM_MODES:
            raise ValueError(f"shm must be one of {', '.join(SHM_MODES)}, got {self.shm!r}")
        for name in ("ipc", "ipc_channel"):
            if getattr(self, name) not in IPC_MODES:
                raise ValueError(f"{name} must be one of {', '.join(IPC_MODES)}, got {getattr(self, name)!r}")
        if not os.path.isabs(self.shm_dir):
            raise ValueError(f"shm_dir must be an absolute path, got {self.shm_dir!r}")
        for name in ("max_staged_bytes", "arena_bytes", "fetch_threads", "fetch_timeout_s", "wait_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def transport(self) -> str:
        return "grpc" if urlsplit(self.url).scheme == "grpc" else "http"

    @classmethod
    def from_extra_config(cls, extra: Mapping) -> ConnectorOptions:
        """Parse `ec_connector_extra_config` (JSON values: strings, numbers, booleans); ValueError naming the
        key for anything unknown or malformed."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"ec_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if not extra.get("url"):
            raise ValueError("ec_connector_extra_config: 'url' (the encoder service, http://... or grpc://...) "
                             "is required")
        parsers: dict[str, Callable] = {
            "url": str, "auth_token": lambda v: str(v) if v else None, "shm": _shm_mode, "shm_dir": str,
            "ipc": _ipc_mode, "ipc_channel": _ipc_mode,
            "max_staged_bytes": _size, "arena_bytes": _size, "fetch_threads": int,
            "fetch_timeout_s": float, "wait_timeout_s": float,
            "release_on_finish": lambda v: v if isinstance(v, bool) else parse_bool(v)}
        values = {}
        for key, value in extra.items():
            try:
                values[key] = parsers[key](value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"ec_connector_extra_config[{key!r}]: {exc}") from None
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"ec_connector_extra_config: {exc}") from None


def _size(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else parse_size(value)


def _ipc_mode(value) -> str:
    if isinstance(value, bool):
        return "auto" if value else "off"
    text = str(value).strip().lower()
    return text if text in IPC_MODES else ("auto" if parse_bool(text) else "off")


def _shm_mode(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    return text if text in SHM_MODES else ("on" if parse_bool(text) else "off")
