"""The embedding push to SGLang's language side: a ZMQ PUSH that connects to the PULL socket it bound.

One message per part and destination: `[header, rows]`, or `[error header]` alone. Two kinds of
destinations:
  - zmq_to_scheduler: every TP rank of a language server binds one PULL port for its lifetime and names it
    in /scheduler_receive_url; we keep one PUSH socket per such endpoint (bounded LRU; a socket whose send
    timed out is closed, not reused).
  - zmq_to_tokenizer: the tokenizer binds a PULL port per request (prefill_host:embedding_port of /encode);
    a fresh PUSH socket per send, closed right after (a cached one would leak, and a port reused later
    would deliver to another request).
Every send is bounded in time (`send_timeout_s`): IMMEDIATE keeps messages off peers that are not
connected, so a vanished receiver makes the send time out instead of queueing or hanging. Rows go out
without a copy (the frame holds the tensor's buffer until ZMQ is done with it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import OrderedDict

import zmq
import zmq.asyncio

from encoder_service import errors

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 30.0
DEFAULT_MAX_SOCKETS = 64
LINGER_MS = 5000  # a closed per-request socket keeps delivering what it has queued this long
SNDHWM = 64  # messages queued per socket at most


def endpoint(host_port: str) -> str:
    """'host:port' or '[v6]:port' (as SGLang writes it) -> 'tcp://...'; InvalidInput for anything else."""
    host, sep, port = str(host_port).rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise errors.InvalidInput(f"receive address must be host:port, got {host_port!r:.200}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(bare)
        host = f"[{ip}]" if ip.version == 6 else str(ip)
    except ValueError:
        if not all(c.isalnum() or c in "-." for c in bare) or len(bare) > 253:
            raise errors.InvalidInput(f"receive address has a bad host: {host_port!r:.200}") from None
    return f"tcp://{host}:{int(port)}"


class Pusher:
    def __init__(self, *, send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S, max_sockets: int = DEFAULT_MAX_SOCKETS):
        self.send_timeout_s = send_timeout_s
        self.max_sockets = max_sockets
        self._ctx = zmq.asyncio.Context()
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)
        return sock

    def _persistent(self, address: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(address)
        if sock is not None:
            self._sockets.move_to_end(address)
            return sock
        while len(self._sockets) >= self.max_sockets:
            _, old = self._sockets.popitem(last=False)
            old.close()
        sock = self._sockets[address] = self._socket(address)
        return sock

    async def send(self, host_port: str, frames: list, *, persistent: bool) -> None:
        """Send `frames` to the PULL socket at host_port; Unavailable when it can't be done in time."""
        address = endpoint(host_port)
        sock = self._persistent(address) if persistent else self._socket(address)
        try:
            await asyncio.wait_for(sock.send_multipart(frames, copy=False), self.send_timeout_s)
        except (TimeoutError, zmq.ZMQError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            reason = f"timed out after {self.send_timeout_s:g}s" if timed_out else f"failed ({exc})"
            if persistent and self._sockets.get(address) is sock:
                del self._sockets[address]
            sock.close(linger=0)  # never deliver a stale message later
            raise errors.Unavailable(
                f"pushing the embeddings to {host_port} {reason}: "
                "is the language server's receiver reachable from this host (SGLANG_HOST_IP)?") from None
        if not persistent:
            sock.close()  # lingers until what it queued is delivered (LINGER_MS at most)

    async def close(self) -> None:
        """Close every socket; what closed per-request sockets still hold gets its linger, on a thread."""
        for sock in self._sockets.values():
            sock.close(linger=LINGER_MS)
        self._sockets.clear()
        await asyncio.to_thread(self._ctx.term)
