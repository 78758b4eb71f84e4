"""The consumer's arena mappings (client/ipc.py): which server's arenas stay open and when one is closed.

  - `Generations`: a new generation at a server's address is a restart (the old arena closed); several
    replicas answering at one address (a Service, the channel off) are not taken for restarts, one after
    the other (each switch used to close the other's arena and open it again);
  - `_Mappings`: a mapping is closed only when no copy uses it (a `forget` from another thread while a copy
    is queued waits for it), and at most `limit` are kept (the least recently used idle one closed).
The arenas are the host stand-in's (encoder_service/testing/host_ipc.py): files mapped as CUDA IPC opens them.
"""

from __future__ import annotations

import torch

from encoder_service.client.ipc import Generations, _Mappings
from encoder_service.testing.host_ipc import HostStandInMemory, HostStandInReader


def copy_from(reader: HostStandInReader, arena: HostStandInMemory, generation: str) -> None:
    reader.copy(arena.handle, generation, [(0, 16, torch.empty(16, dtype=torch.uint8))])


def test_replicas_behind_one_address_are_not_taken_for_restarts(tmp_path):
    arenas = [HostStandInMemory(4096, str(tmp_path)) for _ in range(2)]
    reader = HostStandInReader(str(tmp_path))
    generations = Generations(reader)
    try:
        for k in range(10):  # the Service's answers come from one replica, then the other
            copy_from(reader, arenas[k % 2], f"g{k % 2}")
            generations.seen("http://service:8000", f"g{k % 2}")
        assert reader.opened <= 3  # the first switch taken for a restart at most
    finally:
        for arena in arenas:
            arena.close()


def test_a_new_generation_at_an_address_closes_the_old_arena(tmp_path):
    old, new = HostStandInMemory(4096, str(tmp_path)), HostStandInMemory(4096, str(tmp_path))
    reader = HostStandInReader(str(tmp_path))
    generations = Generations(reader)
    try:
        for arena, generation in ((old, "g-old"), (new, "g-new")):
            copy_from(reader, arena, generation)
            generations.seen("http://replica-a:8000", generation)
            generations.seen("http://replica-b:8000", "g-b")  # another replica's: untouched
        assert set(reader._maps) == {"g-new"}
    finally:
        old.close()
        new.close()


class Recorded:
    """open/close of _Mappings that say what they did."""

    def __init__(self):
        self.opened, self.closed = [], []

    def open(self, handle: bytes, index: int) -> int:
        self.opened.append(handle)
        return len(self.opened)

    def close(self, key, mapping: int) -> None:
        self.closed.append(key)


def test_a_mapping_forgotten_during_a_copy_is_closed_after_it():
    r = Recorded()
    maps = _Mappings(r.open, r.close, limit=4)
    _, entry = maps.acquire(("g1", 0), b"h1")
    maps.forget("g1")  # another thread: the server restarted
    assert r.closed == []  # the copy queued from it still runs
    maps.release(entry)
    assert r.closed == [("g1", 0)] and len(maps) == 0


def test_at_most_limit_mappings_are_kept():
    r = Recorded()
    maps = _Mappings(r.open, r.close, limit=2)
    busy = maps.acquire(("g1", 0), b"h1")[1]  # in use while others come
    for key in (("g2", 0), ("g3", 0)):
        maps.release(maps.acquire(key, key[0].encode())[1])
    assert r.closed == []  # g1 is past the limit but copied from: kept until its copy ends
    maps.release(busy)
    assert r.closed == [("g1", 0)] and len(maps) == 2
    maps.release(maps.acquire(("g4", 0), b"h4")[1])
    assert r.closed == [("g1", 0), ("g2", 0)]  # the least recently used
    maps.close()
    assert sorted(r.closed) == [("g1", 0), ("g2", 0), ("g3", 0), ("g4", 0)]
