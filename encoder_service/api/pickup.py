"""Rows a gRPC Fetch leaves for its client to take over the HTTP port (FetchRequest.pickup).

gRPC's Python message handling copies every message several times and one channel is one TCP stream, so a
gRPC client that asks for it gets the header on the stream and a ticket; it reads the rows with the HTTP
fetch reader (rowpath/raw_http.py), straight into its buffer, on connections of its own.

A ticket is `secrets.token_urlsafe(32)` (256 random bits: unguessable), names exactly one fetch's answer,
works once (taken on first claim) and expires TTL_S after it is made; the claim also needs the call's
credentials (the bearer token, when the service has one). Waiting rows are bounded in count and bytes: when
full, the stream carries the rows itself. Expired tickets are dropped whenever a ticket is made (no timer).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Callable

import torch

from encoder_service.protocol.wire import WireHeader

TTL_S = 10.0  # the client claims at once; this only bounds how long unclaimed rows stay referenced
MAX_TICKETS = 1024
MAX_BYTES = 4 << 30  # rows are views of cache entries; this bounds what evicted entries can keep alive


class Pickups:
    def __init__(self, ttl_s: float = TTL_S, max_tickets: int = MAX_TICKETS, max_bytes: int = MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        self._ttl_s, self._max_tickets, self._max_bytes, self._clock = ttl_s, max_tickets, max_bytes, clock
        self._waiting: OrderedDict[str, tuple[float, WireHeader, torch.Tensor]] = OrderedDict()  # by age
        self._bytes = 0

    def put(self, header: WireHeader, rows: torch.Tensor) -> str | None:
        """A ticket for (header, rows), or None when too many rows are waiting already."""
        now = self._clock()
        while self._waiting and next(iter(self._waiting.values()))[0] <= now:
            self._drop(next(iter(self._waiting)))
        if len(self._waiting) >= self._max_tickets or self._bytes + header.payload_bytes > self._max_bytes:
            return None
        token = secrets.token_urlsafe(32)
        self._waiting[token] = (now + self._ttl_s, header, rows)
        self._bytes += header.payload_bytes
        return token

    def take(self, token: str) -> tuple[WireHeader, torch.Tensor] | None:
        """The rows of `token` (which stops working), or None when it is unknown, used or expired."""
        if token not in self._waiting:
            return None
        expires, header, rows = self._drop(token)
        return (header, rows) if self._clock() < expires else None

    def _drop(self, token: str):
        entry = self._waiting.pop(token)
        self._bytes -= entry[1].payload_bytes
        return entry

    def __len__(self) -> int:
        return len(self._waiting)
