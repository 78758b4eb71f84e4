"""The scheduler side, vLLM-free: which items are staged for which requests, fetches ahead of need (fetch.py)
within a byte budget, and each step's loads for the workers (worker.py: ItemLoad)."""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

from encoder_service.integrations.vllm.arenas import StagedRows
from encoder_service.integrations.vllm.fetch import ItemUnavailable, RowFetcher
from encoder_service.integrations.vllm.worker import ItemLoad

log = logging.getLogger("encoder_service.integrations.vllm")


@dataclass(frozen=True)
class Need:
    """An item a request still needs: vLLM's key, our id, the rows vLLM planned for its placeholder, and for a
    video its frame groups (None: an image)."""

    identifier: str
    item_id: str
    num_rows: int
    groups: int | None = None


PENDING, READY = "pending", "ready"


def _shape(item) -> str:
    return f"{item.num_rows} rows" + ("" if item.groups is None else f" in {item.groups} frame groups")


@dataclass(eq=False)
class _Entry:
    item_id: str
    num_rows: int
    groups: int | None
    nbytes: int  # estimated until staged
    state: str = PENDING
    staged: StagedRows | None = None
    waiting: set[str] = field(default_factory=set)  # requests that need it and have not had it allocated
    held: bool = False  # vLLM holds it in its encoder cache (a load was queued, no free since)


class StagingTable:
    """The scheduler side, vLLM-free: which items are staged, fetches ahead of need, loads for the workers.

    Every method runs on the scheduler's thread; fetches run on `fetch_threads` threads and report back
    through a queue that `ensure` and `end_step` drain, so a hook never waits on the network.
      ensure(request_id, needs) -> bool   True when every needed item is staged (vLLM may schedule it);
                                          starts missing fetches, fails the request on a bad item
      has(identifier) -> bool             staged (vLLM's has_cache_item)
      allocated(request_id, identifier)   vLLM took the item for this request: queue its load
      end_step(freed) -> [ItemLoad]       the step's loads; forget items vLLM evicted (free_encoder_mm_hashes)
      take_failed() -> set[str]           requests to fail, each reported once
      finished(request_id, item_ids)      the request is done: release its pins
    """

    def __init__(self, fetcher: RowFetcher, clock: Callable[[], float] = time.monotonic):
        self.fetcher, self.options, self._clock = fetcher, fetcher.options, clock
        self._pool = ThreadPoolExecutor(max_workers=self.options.fetch_threads, thread_name_prefix="encsvc-fetch")
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._entries: dict[str, _Entry] = {}  # item id -> entry
        self._item_of: dict[str, str] = {}  # vLLM identifier -> our item id
        self._since: dict[str, float] = {}  # request -> when it started waiting
        self._failed: dict[str, str] = {}  # request -> why, not yet reported
        self._reported: set[str] = set()  # failed and reported; until finished
        self._loads: dict[str, ItemLoad] = {}
        self.counters = dict(fetches=0, fetch_failures=0, loads=0, staged_bytes=0, failed_requests=0)

    # -- hooks -------------------------------------------------------------------------------------------
    def ensure(self, request_id: str, needs: Iterable[Need]) -> bool:
        self._drain()
        if request_id in self._failed or request_id in self._reported:
            return False
        ready = True
        for need in needs:
            self._item_of[need.identifier] = need.item_id
            entry = self._entries.get(need.item_id)
            if entry is None:
                entry = self._start(need)
                if entry is None:  # over the staging budget: retried on a later step
                    ready = False
                    continue
            entry.waiting.add(request_id)
            if entry.state != READY:
                ready = False
            elif (entry.num_rows, entry.groups) != (need.num_rows, need.groups):
                self.fail(request_id, f"item {need.item_id!r} was staged as {_shape(entry)}, this request's "
                                      f"placeholder has {_shape(need)}")
                return False
        if ready:
            self._since.pop(request_id, None)
            return True
        waited = self._clock() - self._since.setdefault(request_id, self._clock())
        if waited > self.options.wait_timeout_s:
            self.fail(request_id, f"its items were not staged within {self.options.wait_timeout_s:g} s")
        return False

    def has(self, identifier: str) -> bool:
        entry = self._entries.get(self._item_of.get(identifier, identifier))
        return entry is not None and entry.state == READY

    def allocated(self, request_id: str, identifier: str, num_rows: int) -> None:
        entry = self._entries.get(self._item_of.get(identifier, identifier))
        if entry is None or entry.state != READY:
            # vLLM allocated an item we don't have: it plans a local encode (no pixels on a consumer).
            self.fail(request_id, f"vLLM scheduled item {identifier!r} before it was staged")
            log.error("item %s allocated by vLLM for %s but not staged here", identifier, request_id)
            return
        entry.waiting.discard(request_id)
        entry.held = True
        if identifier not in self._loads:
            self._loads[identifier] = ItemLoad(identifier, num_rows, self.fetcher.load_ref(entry.staged))

    def end_step(self, freed: Iterable[str] = ()) -> list[ItemLoad]:
        self._drain()
        loads, self._loads = list(self._loads.values()), {}
        self.counters["loads"] += len(loads)
        for identifier in freed:
            entry = self._entries.get(self._item_of.get(identifier, identifier))
            if entry is not None:
                entry.held = False
        for item_id in [i for i, e in self._entries.items() if e.state == READY and not e.held and not e.waiting]:
            self._drop(item_id)
        return loads

    def take_failed(self) -> set[str]:
        failed = set(self._failed)
        self._reported |= failed
        self._failed.clear()
        return failed

    def fail(self, request_id: str, why: str) -> None:
        if request_id in self._failed or request_id in self._reported:
            return
        log.error("encoder_service connector: failing request %s: %s", request_id, why)
        self._failed[request_id] = why
        self.counters["failed_requests"] += 1
        self._since.pop(request_id, None)
        for entry in self._entries.values():
            entry.waiting.discard(request_id)

    def finished(self, request_id: str, item_ids: Iterable[str] = ()) -> None:
        self._since.pop(request_id, None)
        self._failed.pop(request_id, None)
        self._reported.discard(request_id)
        for entry in self._entries.values():
            entry.waiting.discard(request_id)
        ids = sorted(set(item_ids))
        if ids and self.options.release_on_finish:
            self._pool.submit(self.fetcher.release, ids)

    def why(self, request_id: str) -> str | None:
        return self._failed.get(request_id)

    def staged_bytes(self) -> int:
        return sum(e.staged.nbytes for e in self._entries.values() if e.staged is not None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for item_id in list(self._entries):
            self._drop(item_id)
        self.fetcher.close()

    # -- internals -------------------------------------------------------------------------------------------
    def _ahead_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if not e.held)

    def _start(self, need: Need) -> _Entry | None:
        width = self.fetcher.expected_width or 0
        nbytes = (need.num_rows + 1) * width * 2
        ahead = self._ahead_bytes()
        if ahead and ahead + nbytes > self.options.max_staged_bytes:
            return None
        entry = _Entry(need.item_id, need.num_rows, need.groups, nbytes)
        self._entries[need.item_id] = entry
        self.counters["fetches"] += 1
        self._pool.submit(self._fetch, entry)
        return entry

    def _fetch(self, entry: _Entry) -> None:
        try:
            result = self.fetcher.fetch(entry.item_id, entry.num_rows, entry.groups)
        except ItemUnavailable as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - reported as the item's failure, not lost on a thread
            result = ItemUnavailable(f"fetch of item {entry.item_id!r} failed: {type(exc).__name__}: {exc}")
        self._done.put((entry, result))

    def _drain(self) -> None:
        while True:
            try:
                entry, result = self._done.get_nowait()
            except queue.Empty:
                return
            if self._entries.get(entry.item_id) is not entry:  # dropped meanwhile (closed)
                if isinstance(result, StagedRows):
                    self.fetcher.drop(result)
                continue
            if isinstance(result, StagedRows):
                entry.staged, entry.state, entry.nbytes = result, READY, result.nbytes
                self.counters["staged_bytes"] += result.nbytes
                continue
            self.counters["fetch_failures"] += 1
            del self._entries[entry.item_id]  # a later request for the id tries again
            for request_id in sorted(entry.waiting):
                self.fail(request_id, str(result))

    def _drop(self, item_id: str) -> None:
        entry = self._entries.pop(item_id, None)
        if entry is not None and entry.staged is not None:
            self.fetcher.drop(entry.staged)
            entry.staged = None
