"""The device row arena: recent images' rows kept on the encoder's GPU, as the ViT wrote them, for consumers on
this host to copy GPU to GPU (protocol/ipc.py; the fetch: core/ipc_fetch.py).

One allocation of `memory.nbytes` (runtime/arena_memory.py: cudaMalloc, exported once as an IPC handle; the
CPU tests' host stand-in: encoder_service/testing/host_ipc.py), cut into byte ranges (`Slot`s) by a ring:

  store(outputs)      the GPU thread, right after a batch: a slot per image (None: no room), and the
                      device-to-device copy of its rows into it queued on the current (the copier's side) stream
                      (runtime/transfer.py: before the copy to the host, so the same event covers both)
  bind(slots, rows)   once that event is done: each slot now mirrors the image's host rows (the owned tensor the
                      cache entry takes). The link is the host rows' storage: while it lives, its bytes and the
                      slot's are the same rows (an entry's rows never change); when it is freed (the entry
                      evicted, nothing else holding it) a finalizer drops the link and the slot's bytes are free
  place(parts, hold)  a fetch's rows (host tensors: views of entries) -> each one's byte offset in the arena,
                      or a reason why not (a row not here: rows from Redis, an entry older than the ring, a slot
                      lost to a newer image); with `hold` a token that keeps those slots from reuse until
                      `release(token)` or the lease (`lease_s` from now) ends
  release(tokens)     the consumers' acknowledgements: their copies are done

The ring: the next slot goes at the head (after the last one), wrapping to 0 at the end; slots in the way are
dropped, oldest first, unless held: then the slot goes after the held one, or nowhere (that image's rows are in
host memory only). So a range being read is never rewritten; everything else is a cache of recent rows.

Threads: `store` runs on the engine's GPU thread, `bind` on its completion thread, `place` / `release` on the
event loop, the finalizers wherever the last reference to a storage goes. One lock; a finalizer only queues
its slot (handled by the next caller that holds the lock), so it never waits for the lock.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

MAX_HOLDS = 4096  # live hold tokens at once: past it a fetch is answered "unavailable" (its consumer falls back)
PENDING, BOUND, ORPHAN = "pending", "bound", "orphan"  # written, not yet bound / mirrors host rows / rows freed


class ArenaMemory(Protocol):
    """The arena's memory: one allocation on `device`, `bytes` a uint8 tensor over all of it, `handle` what a
    consumer opens (64 bytes), `kind` the protocol's name for it."""

    kind: str
    nbytes: int
    handle: bytes
    device: torch.device
    bytes: torch.Tensor

    def close(self) -> None: ...


@dataclass(eq=False)
class Slot:
    offset: int
    nbytes: int
    seq: int  # allocation number: a range's generation (the same bytes reused get a higher one)
    state: str = PENDING
    storage: weakref.ref | None = None  # the host rows' storage it mirrors (BOUND)
    key: int = 0  # that storage's data_ptr (its key in the arena's index)
    base: int = 0  # byte offset of those rows in that storage
    holds: int = 0
    dead: bool = False  # dropped from the ring (its bytes may be rewritten)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(eq=False)
class Hold:
    token: str
    slots: tuple[Slot, ...]
    deadline: float
    on_ack: Callable[[], None] | None = field(default=None, repr=False)  # called after an acknowledgement only


class DeviceArena:
    def __init__(self, memory: ArenaMemory, *, lease_s: float, max_holds: int = MAX_HOLDS,
                 clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.memory, self.lease_s, self.max_holds, self._clock = memory, lease_s, max_holds, clock
        self.generation = secrets.token_hex(8)  # a new process, a new allocation: consumers open it again
        self._lock = threading.Lock()
        self._slots: list[Slot] = []  # live slots, by offset (they never overlap)
        self._offsets: list[int] = []  # their offsets, for bisect
        self._head = 0
        self._seq = itertools.count(1)
        self._by_storage: dict[int, Slot] = {}  # host storage data_ptr -> the slot mirroring it
        self._gone: collections.deque[Slot] = collections.deque()  # slots whose host storage was freed
        self._holds: dict[str, Hold] = {}
        self._expiry: collections.deque[Hold] = collections.deque()  # in deadline order (one lease for all)
        self.counts = dict(stored=0, stored_bytes=0, not_stored=0, placed=0, held=0, not_placed=0, holds_full=0,
                           acked=0, expired=0)

    @property
    def capacity(self) -> int:
        return self.memory.nbytes

    # ---- the engine's side ---------------------------------------------------------------------------------
    def store(self, outputs: Sequence[torch.Tensor]) -> list[Slot | None]:
        """A slot per output (None: no room, too big, another device), its copy queued on the current stream."""
        with self._lock:
            self._collect()
            slots = [self._allocate(o.numel() * o.element_size()) if self._fits(o) else None for o in outputs]
            for s in slots:
                self.counts["stored" if s is not None else "not_stored"] += 1
                self.counts["stored_bytes"] += s.nbytes if s is not None else 0
        for o, s in zip(outputs, slots):
            if s is not None:  # the GPU thread alone allocates: nobody drops this slot before the copy is queued
                self.memory.bytes[s.offset:s.end].copy_(o.reshape(-1).view(torch.uint8), non_blocking=True)
        return slots

    def _fits(self, o: torch.Tensor) -> bool:
        return o.device == self.memory.device and o.is_contiguous() and o.numel() > 0

    def bind(self, slots: Sequence[Slot | None], rows: Sequence[torch.Tensor]) -> None:
        """The slots' copies are done: each mirrors its image's host rows from now on (a slot the ring dropped
        meanwhile mirrors nothing)."""
        with self._lock:
            self._collect()
            for slot, r in zip(slots, rows):
                if slot is None or slot.dead or r.numel() * r.element_size() != slot.nbytes or not r.is_contiguous():
                    continue
                storage = r.untyped_storage()
                slot.state, slot.storage, slot.key = BOUND, weakref.ref(storage), storage.data_ptr()
                slot.base = r.data_ptr() - slot.key
                self._by_storage[slot.key] = slot
                weakref.finalize(storage, self._gone.append, slot).atexit = False

    # ---- the fetch's side ------------------------------------------------------------------------------------
    def place(self, parts: Sequence[torch.Tensor], *, hold: bool,
              on_ack: Callable[[], None] | None = None) -> tuple[list[int], str | None] | str:
        """(each part's byte offset in the arena, the hold token or None) when every part's rows are here;
        else why not (a sentence). `on_ack` runs once the token is acknowledged (not when it expires)."""
        with self._lock:
            self._collect()
            found = [self._locate(p) for p in parts]
            if any(f is None for f in found):
                self.counts["not_placed"] += 1
                return "a row of this fetch is not in the device arena (in host memory only)"
            self.counts["placed"] += 1
            if not hold:
                return [offset for _, offset in found], None
            if len(self._holds) >= self.max_holds:
                self.counts["holds_full"] += 1
                return f"the device arena's holds are full ({self.max_holds} live tokens)"
            slots = tuple(dict.fromkeys(slot for slot, _ in found))
            h = Hold(secrets.token_hex(16), slots, self._clock() + self.lease_s, on_ack)
            for slot in slots:
                slot.holds += 1
            self._holds[h.token] = h
            self._expiry.append(h)
            self.counts["held"] += 1
            return [offset for _, offset in found], h.token

    def release(self, tokens: Sequence[str]) -> int:
        """Acknowledged holds end (unknown, expired or repeated tokens are ignored); how many were live."""
        with self._lock:
            self._collect()
            acked = [h for h in (self._holds.pop(t, None) for t in tokens) if h is not None]
            for h in acked:
                self._unhold(h)
            self.counts["acked"] += len(acked)
        for h in acked:
            if h.on_ack is not None:
                h.on_ack()
        return len(acked)

    def stats(self) -> dict:
        with self._lock:
            self._collect()
            held = {s for h in self._holds.values() for s in h.slots}
            return dict(self.counts, capacity_bytes=self.capacity, slots=len(self._slots),
                        bytes=sum(s.nbytes for s in self._slots if s.state == BOUND), holds=len(self._holds),
                        held_bytes=sum(s.nbytes for s in held))

    def close(self) -> None:
        self.memory.close()

    # ---- internals (under the lock) ---------------------------------------------------------------------------
    def _locate(self, part: torch.Tensor) -> tuple[Slot, int] | None:
        if part.device.type != "cpu" or not part.is_contiguous():
            return None
        storage = part.untyped_storage()
        slot = self._by_storage.get(storage.data_ptr())
        if slot is None or slot.dead or slot.state != BOUND or slot.storage() is not storage:
            return None
        at = part.data_ptr() - storage.data_ptr() - slot.base
        if at < 0 or at + part.numel() * part.element_size() > slot.nbytes:
            return None
        return slot, slot.offset + at

    def _allocate(self, nbytes: int) -> Slot | None:
        """A slot of `nbytes` at the head, or past the held slots in the way (wrapping once); None if none."""
        if not 0 < nbytes <= self.capacity:
            return None
        start, at, wrapped = self._head, self._head, False
        for _ in range(len(self._slots) + 3):  # each turn passes a held slot, or wraps (once)
            if at + nbytes > self.capacity:
                if wrapped or start == 0:
                    return None  # every place was tried
                at, wrapped = 0, True
            elif wrapped and at >= start:
                return None  # past the head again: every place was tried
            in_the_way = self._overlapping(at, at + nbytes)
            held = [s for s in in_the_way if s.holds]
            if held:
                at = max(s.end for s in held)
                continue
            for s in in_the_way:
                self._drop(s)
            slot = Slot(at, nbytes, next(self._seq))
            i = bisect.bisect_left(self._offsets, at)
            self._slots.insert(i, slot)
            self._offsets.insert(i, at)
            self._head = slot.end
            return slot
        return None

    def _overlapping(self, lo: int, hi: int) -> list[Slot]:
        i = max(0, bisect.bisect_right(self._offsets, lo) - 1)
        out = []
        while i < len(self._slots) and self._slots[i].offset < hi:
            if self._slots[i].end > lo:
                out.append(self._slots[i])
            i += 1
        return out

    def _drop(self, slot: Slot) -> None:
        i = bisect.bisect_left(self._offsets, slot.offset)
        if i < len(self._slots) and self._slots[i] is slot:
            del self._slots[i], self._offsets[i]
        slot.dead = True
        self._unindex(slot)

    def _unindex(self, slot: Slot) -> None:
        if self._by_storage.get(slot.key) is slot:
            del self._by_storage[slot.key]

    def _unhold(self, h: Hold) -> None:
        for slot in h.slots:
            slot.holds -= 1
            if slot.holds == 0 and slot.state == ORPHAN:
                self._drop(slot)

    def _collect(self) -> None:
        """Holds past their lease end; slots whose host rows were freed let their bytes go (once unheld)."""
        now = self._clock()
        while self._expiry and self._expiry[0].deadline <= now:
            h = self._expiry.popleft()
            if self._holds.get(h.token) is h:
                del self._holds[h.token]
                self._unhold(h)
                self.counts["expired"] += 1
        if len(self._expiry) > 2 * self.max_holds:  # acknowledged holds waiting for their deadline here
            self._expiry = collections.deque(h for h in self._expiry if self._holds.get(h.token) is h)
        while self._gone:
            slot = self._gone.popleft()
            if slot.dead or slot.state != BOUND:
                continue
            self._unindex(slot)
            slot.state, slot.storage = ORPHAN, None
            if not slot.holds:
                self._drop(slot)
