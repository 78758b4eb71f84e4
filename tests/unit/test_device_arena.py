"""The device row arena's ring, bindings, holds and leases (runtime/device_arena.py), on the host-memory stand-in
(encoder_service/testing/host_ipc.py) for its CUDA memory: the same allocator and holds the GPU runs."""

from __future__ import annotations

import gc

import pytest
import torch

from encoder_service.runtime.device_arena import DeviceArena
from encoder_service.runtime.transfer import HostCopier
from encoder_service.testing.host_ipc import HostStandInMemory

ROW = 4 * 16  # bytes of one [1, 16] float32 row


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_arena(tmp_path):
    made = []

    def make(nbytes: int, lease_s: float = 5.0, **kw) -> DeviceArena:
        arena = DeviceArena(HostStandInMemory(nbytes, str(tmp_path)), lease_s=lease_s, **kw)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        arena.close()


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))


def stored(arena: DeviceArena, *outputs: torch.Tensor) -> list[torch.Tensor]:
    """The engine's two steps for a batch: the copy into the arena, then (its event done) the binding to the
    host rows (here the outputs themselves, as the CPU path hands them on)."""
    arena.bind(arena.store(outputs), outputs)
    return list(outputs)


def arena_rows(arena: DeviceArena, offset: int, like: torch.Tensor) -> torch.Tensor:
    return arena.memory.bytes[offset:offset + like.numel() * 4].view(torch.float32).view(like.shape)


def test_placed_rows_are_the_host_rows_at_their_offsets(make_arena):
    arena = make_arena(16 * ROW)
    a, b = stored(arena, rows(4, 1), rows(6, 2))
    placed = arena.place([a[1:3], b, b[5:]], hold=True)
    offsets, token = placed
    assert token is not None
    for part, offset in zip([a[1:3], b, b[5:]], offsets):
        assert torch.equal(arena_rows(arena, offset, part), part)
    assert offsets == [ROW, 4 * ROW, 9 * ROW]  # a at 0, b after it


def test_a_probe_holds_nothing(make_arena):
    arena = make_arena(16 * ROW)
    (a,) = stored(arena, rows(4, 1))
    offsets, token = arena.place([a], hold=False)
    assert token is None and offsets == [0]
    assert arena.stats()["holds"] == 0


def test_rows_not_in_the_arena_are_not_placed(make_arena):
    arena = make_arena(16 * ROW)
    (a,) = stored(arena, rows(4, 1))
    other = rows(4, 1)  # the same values in other memory (say, read from Redis): not in the arena
    assert isinstance(arena.place([a, other], hold=True), str)
    assert isinstance(arena.place([a.clone()], hold=True), str)
    assert arena.stats()["holds"] == 0  # nothing held for an answer that says no


def test_the_ring_drops_the_oldest_rows(make_arena):
    arena = make_arena(10 * ROW)
    a, b = stored(arena, rows(4, 1), rows(4, 2))
    (c,) = stored(arena, rows(4, 3))  # no room after b: wraps to 0, over a
    assert isinstance(arena.place([a], hold=False), str)
    assert arena.place([b], hold=False)[0] == [4 * ROW]
    assert arena.place([c], hold=False)[0] == [0]


def test_a_held_range_is_never_rewritten(make_arena):
    arena = make_arena(10 * ROW)
    a, b = stored(arena, rows(4, 1), rows(4, 2))
    _, token = arena.place([a], hold=True)
    before = arena.memory.bytes[:4 * ROW].clone()
    (c,) = stored(arena, rows(4, 3))  # a is held: c goes after it, over b
    assert arena.place([c], hold=False)[0] == [4 * ROW]
    assert isinstance(arena.place([b], hold=False), str)
    _, token_c = arena.place([c], hold=True)
    (d,) = stored(arena, rows(4, 4))  # a and c held, 2 rows free at the end: no room for 4
    assert isinstance(arena.place([d], hold=False), str)
    assert arena.stats()["not_stored"] == 1
    assert torch.equal(arena.memory.bytes[:4 * ROW], before)
    assert arena.release([token]) == 1
    (e,) = stored(arena, rows(4, 5))  # released: a's bytes may go now
    assert arena.place([e], hold=False)[0] == [0]
    assert isinstance(arena.place([a], hold=False), str)
    assert arena.place([c], hold=False)[0] == [4 * ROW]


def test_holds_end_at_their_lease_and_acks_are_counted_once(make_arena):
    clock = Clock()
    arena = make_arena(10 * ROW, lease_s=2.0, clock=clock)
    a, b = stored(arena, rows(4, 1), rows(4, 2))
    acked = []
    _, t1 = arena.place([a], hold=True, on_ack=lambda: acked.append("a"))
    _, t2 = arena.place([b], hold=True, on_ack=lambda: acked.append("b"))
    assert arena.release([t2, t2, "0" * 32]) == 1 and acked == ["b"]  # repeated and unknown tokens: ignored
    clock.now += 2.0
    stored(arena, rows(4, 3))  # a's hold has expired: the ring may take its bytes
    assert arena.release([t1]) == 0 and acked == ["b"]  # expired: no acknowledgement, no delivery
    assert arena.stats()["expired"] == 1 and arena.stats()["holds"] == 0
    assert isinstance(arena.place([a], hold=False), str)


def test_freed_host_rows_free_their_slot_but_not_while_held(make_arena):
    arena = make_arena(10 * ROW)
    a, b = stored(arena, rows(4, 1), rows(4, 2))
    _, token = arena.place([b], hold=True)
    held_bytes = arena.memory.bytes[4 * ROW:8 * ROW].clone()
    del a, b  # the cache evicted both entries: nothing refers to their host rows
    gc.collect()
    assert arena.stats()["slots"] == 1  # a's slot went; b's stays while held
    (c,) = stored(arena, rows(8, 3))  # 8 rows fit nowhere but over a's bytes and b's held ones
    assert isinstance(arena.place([c], hold=False), str)
    assert torch.equal(arena.memory.bytes[4 * ROW:8 * ROW], held_bytes)
    arena.release([token])
    assert arena.stats()["slots"] == 0
    (d,) = stored(arena, rows(8, 4))
    assert arena.place([d], hold=False)[0] == [0]


def test_a_slot_dropped_before_its_binding_mirrors_nothing(make_arena):
    arena = make_arena(8 * ROW)
    a, b = rows(4, 1), rows(8, 2)
    slots_a = arena.store([a])
    stored(arena, b)  # the next batch takes the whole ring before a's copy was bound
    arena.bind(slots_a, [a])
    assert isinstance(arena.place([a], hold=False), str)
    assert arena.place([b], hold=False)[0] == [0]


def test_what_the_arena_does_not_take(make_arena):
    arena = make_arena(8 * ROW)
    assert arena.store([rows(9, 1), rows(4, 2).t(), torch.empty(0, 16), rows(2, 3)])[:3] == [None, None, None]
    assert arena.stats()["not_stored"] == 3 and arena.stats()["stored"] == 1


def test_holds_are_bounded(make_arena):
    arena = make_arena(8 * ROW, max_holds=2)
    (a,) = stored(arena, rows(4, 1))
    assert arena.place([a], hold=True)[1] and arena.place([a], hold=True)[1]
    assert "full" in arena.place([a], hold=True)
    assert arena.place([a], hold=False)[1] is None  # a probe still answers


def test_each_arena_is_its_own_generation(make_arena):
    assert make_arena(ROW).generation != make_arena(ROW).generation


def test_host_copier_binds_each_image_to_its_host_rows(make_arena):
    arena = make_arena(16 * ROW)
    outputs = [rows(3, 1), rows(5, 2)]
    host = HostCopier(arena=arena).start(outputs).wait()
    offsets, _ = arena.place(host, hold=False)
    for part, offset in zip(host, offsets):
        assert torch.equal(arena_rows(arena, offset, part), part)


def test_no_arena_on_a_cpu_or_when_off(tmp_path):
    from encoder_service.runtime.arena_memory import make_arena

    assert make_arena("cpu", None, 5.0) is None  # auto on a CPU: off (CUDA only)
    assert make_arena("cpu", 1 << 20, 5.0) is None
    assert make_arena("cpu", 0, 5.0, memory=HostStandInMemory.factory(str(tmp_path))) is None  # 0: off
    arena = make_arena("cpu", 1 << 20, 5.0, memory=HostStandInMemory.factory(str(tmp_path)))
    try:
        assert arena.capacity == 1 << 20 and arena.memory.kind == "host-standin"
    finally:
        arena.close()


def test_a_missing_cuda_runtime_is_a_clear_error(monkeypatch):
    """Where no libcudart loads, every IPC call raises CudaIpcError (its callers fall back), never an OSError."""
    from encoder_service.rowpath import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "_lib", None)
    monkeypatch.setattr(cuda_ipc, "_mapped_cudart", lambda: [])
    monkeypatch.setattr(cuda_ipc, "SONAMES", ("libcudart-that-is-not-there.so.99",))
    with pytest.raises(cuda_ipc.CudaIpcError, match="no CUDA runtime library"):
        cuda_ipc.open_handle(b"\0" * 64)


def test_an_ipc_handle_of_any_bytes_survives_the_c_struct():
    """A handle is 64 binary bytes, NULs included: it must come out of (and go into) the C struct whole (a
    c_char array read back cut at the first NUL: a 4-byte handle, caught only on a GPU)."""
    from encoder_service.protocol.ipc import HANDLE_BYTES
    from encoder_service.rowpath.cuda_ipc import _Handle

    raw = bytes([1, 0, 2, 0] + [0] * 56 + [7, 0, 0, 9])
    assert len(raw) == HANDLE_BYTES
    assert bytes(_Handle.from_buffer_copy(raw).reserved) == raw
