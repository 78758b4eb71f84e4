"""Per-part state of SGLang requests: who the embeddings of a part `req_id` go to.

With `zmq_to_scheduler` (SGLang's default for Qwen) a part's /encode and the /scheduler_receive_url calls
of every language-server TP rank arrive in either order; the push waits until `receive_count` ranks have
registered. The table is bounded by entries and time so a client can't make us allocate without bound:
a part lives at most `ttl_s` (SGLang's own receiver gives up after SGLANG_ENCODER_RECV_TIMEOUT, 180 s by
default), at most `max_parts` are open at once (a new one past that is refused: Overloaded), and a part is
dropped as soon as its embeddings went out. A failed part is kept until its TTL as a tombstone holding its
error header, so a rank that registers late still gets the failure instead of waiting for nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from encoder_service import errors

DEFAULT_TTL_S = 180.0
DEFAULT_MAX_PARTS = 4096
MAX_RECEIVE_COUNT = 1024  # TP ranks of one language server


@dataclass
class Part:
    req_id: str
    created: float
    receive_count: int = 0  # 0: no rank registered yet
    receive_urls: list[str] = field(default_factory=list)  # "host:port", registration order, unique
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    encoding: bool = False  # its /encode arrived
    error: bytes | None = None  # the error header once the part failed (late registrations get it)

    def _update(self) -> None:
        if self.receive_count and len(self.receive_urls) >= self.receive_count:
            self.registered.set()


class Sessions:
    """Open parts by req_id, oldest first. Loop-confined (one asyncio loop, no locks)."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, max_parts: int = DEFAULT_MAX_PARTS,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_parts, self._clock = ttl_s, max_parts, clock
        self._parts: OrderedDict[str, Part] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parts)

    def get(self, req_id: str) -> Part | None:
        self.sweep()
        return self._parts.get(req_id)

    def _get_or_create(self, req_id: str) -> Part:
        self.sweep()
        part = self._parts.get(req_id)
        if part is not None:
            return part
        if len(self._parts) >= self.max_parts:
            tombstone = next((k for k, p in self._parts.items() if p.error is not None), None)
            if tombstone is None:
                raise errors.Overloaded(f"{len(self._parts)} SGLang request parts are open (the limit); retry later")
            del self._parts[tombstone]
        part = self._parts[req_id] = Part(req_id, self._clock())
        return part

    def open_encode(self, req_id: str) -> Part:
        """The part of an /encode: a second /encode of the same req_id while the first runs is a Conflict (a
        req_id names one part: its images may be others)."""
        part = self._get_or_create(req_id)
        if part.encoding:
            raise errors.Conflict(f"req_id {req_id!r} is already being encoded (a duplicate /encode: a req_id "
                                  "names one part)")
        part.encoding = True
        return part

    def register(self, req_id: str, receive_url: str, receive_count: int) -> Part:
        """One rank's /scheduler_receive_url: its PULL address joins the part's destinations."""
        if not 0 < receive_count <= MAX_RECEIVE_COUNT:
            raise errors.InvalidInput(f"receive_count must be in 1..{MAX_RECEIVE_COUNT}, got {receive_count}")
        part = self._get_or_create(req_id)
        part.receive_count = max(part.receive_count, receive_count)
        if receive_url not in part.receive_urls:
            if len(part.receive_urls) >= MAX_RECEIVE_COUNT:
                raise errors.InvalidInput(f"req_id {req_id!r} has {MAX_RECEIVE_COUNT} receive URLs already")
            part.receive_urls.append(receive_url)
        part._update()
        return part

    async def wait_registered(self, part: Part) -> list[str]:
        """The part's destinations once `receive_count` ranks registered; DeadlineExceeded past its TTL."""
        remaining = part.created + self.ttl_s - self._clock()
        try:
            await asyncio.wait_for(part.registered.wait(), max(remaining, 0.0))
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"req_id {part.req_id!r}: {len(part.receive_urls)} of {part.receive_count or '?'} language-server "
                f"ranks registered (/scheduler_receive_url) within {self.ttl_s:g}s") from None
        return list(part.receive_urls)

    def finish(self, part: Part) -> None:
        """The part's embeddings went out: forget it."""
        if self._parts.get(part.req_id) is part:
            del self._parts[part.req_id]

    def fail(self, part: Part, error_header: bytes) -> None:
        """Keep the failed part (until its TTL) so late registrations get `error_header`."""
        part.error = error_header

    def sweep(self) -> None:
        """Drop the parts past their TTL (the table is in creation order: stop at the first one that is not)."""
        now = self._clock()
        while self._parts:
            req_id, part = next(iter(self._parts.items()))
            if now - part.created < self.ttl_s:
                break
            del self._parts[req_id]
