"""The one face the core sees of the other replicas: `Replicas`, in two forms. `Solo` (solo.py): one replica,
no Redis, nothing shared: every read is this process's store, every claim, binding and wait answers at once
as if no other replica existed. `Shared` (shared.py): replicas sharing one Redis (standalone, Cluster or
Sentinel: redis_connections.py's business), the directory of who holds which id, claims, bindings, kept
inputs, and the row path between replicas (peers.py). The core holds one of them (`form`, __init__.py) and
never asks which.

What needs the core's own machinery stays in the core and is handed in: `TakeOver` (core/take_over.py), the
encode here of an image whose accepting replica is gone (its flights, the engine's admission, the image
reader).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

from encoder_service.cache import CacheKey, Entry, EntryHeader
from encoder_service.replicas.directory import Located, Marked, Settled
from encoder_service.timeouts import Deadline

Key = CacheKey | str


class Claimed(Protocol):
    """What `mark` claims for one accepted id: its key, its content tag (0: a content key), the image bytes
    kept beside the claim (None: none, e.g. a video's frame group)."""

    key: CacheKey
    content_tag: int
    data: bytes | None


class GroupClaim(NamedTuple):
    """What `mark` claims for one frame group of a video: its key and the video's content tag. No bytes are
    kept beside it (`data`): another replica cannot encode one group of a video from them, so a fetch of a
    group whose replica died answers 404 within the claim's TTL (encode the video again)."""

    key: CacheKey
    content_tag: int
    data: None = None


class TakeOver(Protocol):
    """The core's encode here of an image another replica accepted and can no longer give (core/take_over.py)."""

    async def num_tokens(self, key: CacheKey) -> int | None:
        """Its row count once taken over here (a flight), or None: its bytes are gone too."""

    async def rows(self, key: CacheKey, start: int, end: int) -> torch.Tensor | None:
        """Rows [start, end) once encoded here, or None: its bytes are gone too."""


class Replicas(Protocol):
    """`key` is a `CacheKey` or its full name. Event loop only."""

    # ---- lifecycle and what is shown --------------------------------------------------------------------
    owner: str | None  # this process in the directory (other replicas' signed fetches address it); None: solo

    @property
    def owner_url(self) -> str | None:
        """Where clients and other replicas fetch this replica's rows directly; None: nobody else can."""

    def advertise(self, url: str | None) -> None:
        """Before `start`: the address other replicas fetch this one's rows at (its HTTP port)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def readiness(self) -> dict:
        """Readiness detail: {"redis": "off"}, or the Redis tier's state and kind ("redis", "redis_detail")."""

    def stats(self) -> dict:
        """Flat counters: the store's (`local_*`) and, shared, the tier's (`redis_*`), the row path's
        (`peer_*`) and the face's own (core/cache_metrics.py names each)."""

    # ---- reads: this process's store first, then what other replicas left -------------------------------
    async def get(self, key: Key) -> Entry | None:
        """The whole entry: the store's, else a row copy another replica wrote (kept here now)."""

    async def header(self, key: Key) -> EntryHeader | None:
        """The entry's header: the store's, else the directory's (the rows stay where they are)."""

    async def locate(self, key: Key, *, strict: bool = True) -> Located | None:
        """Where another replica's rows of `key` are; None: nowhere known. `strict`: Unavailable while the
        directory cannot be read, else None then."""

    async def pull(self, key: CacheKey) -> Entry | None:
        """The whole rows from the replica holding them, not kept here yet; None: no live replica gives them."""

    # ---- writes ---------------------------------------------------------------------------------------------
    def put(self, key: Key, entry: Entry) -> None:
        """Rows that landed here: into the store, and where they are written behind for the others."""

    def failed(self, key: Key, exc: BaseException) -> None:
        """The encode of `key` failed or was dropped: those waiting for it elsewhere hear it."""

    async def withdraw(self, key: Key, tag: int) -> None:
        """An encode of caller id `key` found rows of other content (`tag`): its claim goes."""

    # ---- an encode's claims, bindings and waits -------------------------------------------------------------
    async def bind_tags(self, tags: Mapping[CacheKey, int]) -> dict[str, int]:
        """Caller ids bound to one content across replicas: by name, the tag each is bound to now; {}: nobody
        else can tell."""

    def mark(self, misses: Sequence[Claimed], hits: Sequence[CacheKey]) -> asyncio.Task | None:
        """Claim an encode's admitted `misses` and share its local `hits`: a task returning the claims'
        `Marked`, awaited before the encode answers; None: nothing to claim."""

    async def mark_pending(self, keys: Iterable[Key], lease_s: float | None = None,
                           tags: Mapping[str, int] | None = None, inputs: Mapping[str, bytes] | None = None
                           ) -> Marked:
        """Claim `keys` for their lease; `Marked.elsewhere`: those another replica claimed first."""

    async def wait_for(self, key: Key, timeout_s: float | None) -> Settled:
        """Wait for another replica's encode of `key` (timeouts.py: None no bound, 0 don't wait)."""

    async def input(self, key: Key) -> bytes | None:
        """The bytes of an image another replica accepted, kept while it is encoded; None: none kept."""

    # ---- a fetch of an id no tier here has ------------------------------------------------------------------
    async def num_tokens_elsewhere(self, key: CacheKey, deadline: Deadline, take_over: TakeOver) -> int:
        """Its row count from where its rows are (or will be, within `deadline`), or raises what the fetch
        answers (NotFound, DeadlineExceeded, Unavailable, the encode's failure)."""

    async def rows_elsewhere(self, key: CacheKey, start: int, end: int, take_over: TakeOver
                             ) -> torch.Tensor | None:
        """Rows [start, end) from where they are; None: nobody has them nor their bytes (404)."""
