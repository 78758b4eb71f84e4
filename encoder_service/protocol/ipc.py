"""The fetch by IPC both ends agree on: rows GPU to GPU on one host (server: core/ipc_fetch.py over the device
row arena, runtime/device_arena.py; consumer: client/ipc.py).

The consumer asks for it in a fetch (HTTP JSON `"ipc": IpcRequest.to_dict()` beside items/start/end), naming
its host by the kernel's boot id (`this_host()`: containers of one host share it; two hosts never do). The
server answers the wire header's fields and, instead of rows, `"ipc"`:

  - `IpcPlacement`: every segment's rows sit in the server's arena, one device allocation of `size` bytes
    exported once as a CUDA IPC handle (64 bytes, base64), at `offsets[k]` (segment k's rows are
    `num_rows x row_bytes` bytes from there, row-major, as on the wire). `generation` is random per server
    process (a restarted server has a new allocation, so a new handle: open it again). `token` holds those
    byte ranges for the consumer: the server never reuses them until the token is acknowledged (POST
    /v1/fetch/ack {"tokens"}, or `ack` in a later fetch's request) or `lease_s` has passed since it placed
    them (after it got the request). So a consumer that measures from before sending its request to after
    its copies finished, and finds less than `lease_s`, read rows the server kept still; past that it must
    not use them (fetch again another way).
    A probe (`hold` false) answers where the rows are and holds nothing (`token` None: never read them).
    An encode may ask for its images' rows the same way (HTTP JSON `"ipc"`, or the query's `ipc_host` /
    `ipc_ack`; implies wait): each image's answer carries its `"ipc"` (one segment: all its rows), placed once
    they landed; its `lease_s` counts from the receipt of the encode request too (what the encode took added).
  - `IpcUnavailable(reason, owner)`: not this fetch (IPC off, another host, a row not in the arena, holds
    full): the consumer fetches the same chunk the next way (shared memory, then the socket). Not an error.
    `owner`: an id of the fetch is on another replica (not held nor encoded here), whose advertised address
    this is (None: unknown): a consumer that can reach it asks it by IPC instead. Such an answer, like every
    one the server can give before reading rows (IPC off, another host), comes before any wait and carries
    no segments.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass

BOOT_ID = "/proc/sys/kernel/random/boot_id"
HANDLE_BYTES = 64  # an arena's handle: sizeof(cudaIpcMemHandle_t), raw bytes (rowpath/cuda_ipc.py)
MAX_ACK_TOKENS = 1024  # tokens one request may acknowledge
TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")

_host: str | None = None


def this_host() -> str:
    """This host's boot id ('' when unreadable: then no server takes us for a neighbour)."""
    global _host
    if _host is None:
        try:
            with open(BOOT_ID) as f:
                _host = f.read().strip()
        except OSError:
            _host = ""
    return _host


class IpcError(ValueError):
    """A malformed IPC request or answer."""


@dataclass(frozen=True)
class IpcRequest:
    host: str  # the consumer's boot id
    hold: bool = True  # False: a probe (nothing held, nothing to read)
    ack: tuple[str, ...] = ()  # tokens of earlier IPC fetches whose copies are done

    def __post_init__(self):
        if len(self.ack) > MAX_ACK_TOKENS:
            raise IpcError(f"{len(self.ack)} hold tokens to acknowledge, over the limit of {MAX_ACK_TOKENS}")
        bad = next((t for t in self.ack if not TOKEN_RE.match(t)), None)
        if bad is not None:
            raise IpcError(f"{bad!r:.60} is not a hold token (32 hex digits)")
        if len(self.host) > 64:
            raise IpcError("ipc.host is a boot id (36 characters), got a longer string")

    def to_dict(self) -> dict:
        return {"host": self.host, "hold": self.hold} | ({"ack": list(self.ack)} if self.ack else {})


@dataclass(frozen=True)
class IpcPlacement:
    kind: str  # rowpath/cuda_ipc.py: KIND ("cuda"), or the CPU tests' stand-in's (testing/host_ipc.py)
    handle: bytes  # HANDLE_BYTES
    generation: str  # per server process
    size: int  # bytes of the arena the handle opens
    offsets: tuple[int, ...]  # byte offset of each segment's rows in the arena, in segment order
    token: str | None  # the hold (None: a probe's answer)
    lease_s: float  # the hold lasts this long at most from the server's receipt of the request

    def to_dict(self) -> dict:
        return {"kind": self.kind, "handle": base64.b64encode(self.handle).decode("ascii"),
                "generation": self.generation, "size": self.size, "offsets": list(self.offsets), "token": self.token,
                "lease_s": self.lease_s}


@dataclass(frozen=True)
class IpcUnavailable:
    reason: str
    owner: str | None = None  # the replica that holds the rows, when this one does not (its advertised URL)

    def to_dict(self) -> dict:
        return {"unavailable": self.reason} | ({"owner": self.owner} if self.owner else {})


def answer_from_dict(d, num_segments: int) -> IpcPlacement | IpcUnavailable:
    """The `"ipc"` of a fetch answer with `num_segments` segments; IpcError when it is not one."""
    try:
        if "unavailable" in d:
            owner = d.get("owner")
            return IpcUnavailable(str(d["unavailable"]), owner if isinstance(owner, str) and owner else None)
        handle = base64.b64decode(d["handle"], validate=True)
        token = d["token"]
        placement = IpcPlacement(str(d["kind"]), handle, str(d["generation"]), int(d["size"]),
                                 tuple(int(o) for o in d["offsets"]), None if token is None else str(token),
                                 float(d["lease_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise IpcError(f"malformed ipc answer: {exc!r:.200}") from None
    if len(handle) != HANDLE_BYTES or len(placement.offsets) != num_segments or min(placement.offsets, default=0) < 0:
        raise IpcError(f"malformed ipc answer: a {len(handle)}-byte handle, {len(placement.offsets)} offsets for "
                       f"{num_segments} segments")
    return placement
