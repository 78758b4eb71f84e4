"""The vLLM connector's scheduler-side books and host arenas (integrations/vllm/staging.py, arenas.py) on their
own: a fake fetcher stands in for the encoder (tests/service/test_vllm_transfer.py has the real one)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from encoder_service.client.shm import ShmBuffers
from encoder_service.integrations.vllm.arenas import RowArenas, StagedRows
from encoder_service.integrations.vllm.fetch import ItemUnavailable, RowFetcher
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.staging import Need, StagingTable
from encoder_service.integrations.vllm.worker import ShmRows
from tests.support.waits import wait_for


class FakeFetcher:
    """fetch() blocks until the test says how the item ends: `finish(item_id)` or `finish(item_id, "why")`.
    fetch runs on the table's pool thread: `wait_fetched(item_id, n)` waits until it has started n times."""

    def __init__(self, **options):
        self.options = ConnectorOptions("http://encoder:1", **options)
        self.expected_width = 4
        self.gates: dict[str, threading.Event] = {}
        self.outcome: dict[str, str | None] = {}
        self.fetched, self.dropped, self.released = [], [], []
        self.groups: dict[str, int | None] = {}  # item -> the frame groups it was fetched with
        self.arenas = None
        self._started = threading.Condition()

    def fetch(self, item_id: str, num_rows: int, groups: int | None = None) -> StagedRows:
        with self._started:
            self.fetched.append(item_id)
            self.groups[item_id] = groups
            self._started.notify_all()
        self.gates.setdefault(item_id, threading.Event()).wait(10)
        if self.outcome.get(item_id):
            raise ItemUnavailable(self.outcome[item_id])
        return StagedRows(item_id, torch.zeros(num_rows, 4), ShmRows("f", "/d", 0, num_rows, 4, "float32"), None, 0,
                          num_rows + 1)

    def wait_fetched(self, item_id: str, times: int = 1) -> None:
        with self._started:
            assert self._started.wait_for(lambda: self.fetched.count(item_id) >= times, timeout=10), self.fetched

    def finish(self, item_id: str, why: str | None = None) -> None:
        self.outcome[item_id] = why
        self.gates.setdefault(item_id, threading.Event()).set()

    def load_ref(self, staged):
        return staged.ref

    def drop(self, staged):
        self.dropped.append(staged.item_id)

    def release(self, ids):
        self.released.append(ids)

    def close(self):
        pass


def settle(table: StagingTable) -> None:
    """Wait for the fetches that were let go to report back."""
    table._pool.shutdown(wait=True)
    table._pool = type(table._pool)(max_workers=2)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_failure_fails_every_waiting_request_once_and_a_new_request_retries():
    fetcher = FakeFetcher()
    table = StagingTable(fetcher)
    need = Need("ident", "img", 3)
    assert not table.ensure("a", [need]) and not table.ensure("b", [need])
    fetcher.wait_fetched("img")
    assert fetcher.fetched == ["img"] and not table.has("ident")
    fetcher.finish("img", "gone")
    settle(table)
    assert not table.ensure("c", [Need("other", "img2", 1)])  # drains: a and b fail
    assert table.take_failed() == {"a", "b"} and table.take_failed() == set()
    assert table.why("a") is None and not table.ensure("a", [need])  # reported: stays off until finished
    table.finished("a")
    table.finished("b")
    fetcher.gates.pop("img")
    assert not table.ensure("d", [need])
    fetcher.wait_fetched("img", 2)
    assert fetcher.fetched.count("img") == 2  # tried again, once
    fetcher.finish("img")
    fetcher.finish("img2")
    settle(table)
    assert table.ensure("d", [need]) and table.has("ident")
    table.close()


def test_items_live_while_waited_for_or_held():
    fetcher = FakeFetcher()
    table = StagingTable(fetcher)
    a, b = Need("A", "a", 2), Need("B", "b", 2)
    for n in (a, b):
        fetcher.finish(n.item_id)
    table.ensure("r", [a, b])
    settle(table)
    assert table.ensure("r", [a, b])
    table.allocated("r", "A", 2)  # vLLM took A; B is later in the prompt (a later chunk)
    loads = table.end_step()
    assert [(x.identifier, x.num_rows) for x in loads] == [("A", 2)] and table.has("A") and table.has("B")
    table.finished("r", ["a", "b", "a"])
    settle(table)
    assert fetcher.released == [["a", "b"]]
    table.end_step()  # B: nobody waits, vLLM never took it -> dropped; A: vLLM still holds it
    assert fetcher.dropped == ["b"] and table.has("A") and not table.has("B")
    table.end_step(freed=["A"])
    assert fetcher.dropped == ["b", "a"] and not table.has("A")
    table.allocated("s", "A", 2)  # vLLM taking an item we don't have fails the request, loudly
    assert table.take_failed() == {"s"}
    table.close()


def test_row_count_mismatch_and_wait_timeout():
    clock = Clock()
    fetcher = FakeFetcher(wait_timeout_s=5)
    table = StagingTable(fetcher, clock=clock)
    fetcher.finish("a")
    table.ensure("r", [Need("A", "a", 2)])
    settle(table)
    assert not table.ensure("other", [Need("A2", "a", 3)])  # staged with 2 rows, this placeholder has 3
    assert "staged as 2 rows, this request's placeholder has 3 rows" in table.why("other")
    fetcher.finish("v")
    table.ensure("r", [Need("V", "v", 8, groups=2)])
    settle(table)
    assert not table.ensure("regrouped", [Need("V2", "v", 8, groups=4)])  # the same rows cut another way
    assert "staged as 8 rows in 2 frame groups" in table.why("regrouped") and "8 rows in 4 frame groups" in \
        table.why("regrouped")
    assert fetcher.groups == {"a": None, "v": 2}
    assert not table.ensure("slow", [Need("S", "s", 1)])
    clock.now = 4.0
    assert not table.ensure("slow", [Need("S", "s", 1)]) and table.why("slow") is None
    clock.now = 6.0
    assert not table.ensure("slow", [Need("S", "s", 1)]) and "within 5 s" in table.why("slow")
    fetcher.finish("s")
    table.close()


def test_fetch_ahead_budget():
    fetcher = FakeFetcher(max_staged_bytes=100)  # estimate: (rows + 1) * width 4 * 2 bytes
    table = StagingTable(fetcher)
    assert not table.ensure("r1", [Need("A", "a", 9)])  # 80 bytes: starts (nothing else ahead)
    assert not table.ensure("r2", [Need("B", "b", 9)])  # 160 > 100: waits
    fetcher.wait_fetched("a")
    assert fetcher.fetched == ["a"]
    fetcher.finish("a")
    settle(table)
    assert table.ensure("r1", [Need("A", "a", 9)])
    table.allocated("r1", "A", 9)
    table.end_step()  # A is vLLM's now: no longer ahead
    assert not table.ensure("r2", [Need("B", "b", 9)])
    fetcher.wait_fetched("b")
    assert fetcher.fetched == ["a", "b"]
    fetcher.finish("b")
    table.close()


def test_arenas(tmp_path):
    buffers = ShmBuffers(str(tmp_path))
    clock = Clock()
    arenas = RowArenas(buffers, arena_bytes=10 * 4 * 4, quarantine_s=5, clock=clock)  # 10 rows of 4 float32
    a1, s1 = arenas.take(4, 4, "float32")
    _, s2 = arenas.take(4, 4, "float32")
    assert (s1, s2) == (0, 4) and len(arenas.names()) == 1
    a3, s3 = arenas.take(4, 4, "float32")  # no room left in the first: a second arena
    assert a3 is not a1 and s3 == 0 and len(arenas.names()) == 2
    big, _ = arenas.take(25, 4, "float32")  # larger than an arena: one of its own size
    assert big.rows.shape == (25, 4)
    arenas.give(a1, s1, 4)
    arenas.give(a1, s2, 4, quarantine=True)  # a failed fetch: its range rests
    assert arenas.take(6, 4, "float32")[0] is not a1
    clock.now = 6
    assert arenas.take(6, 4, "float32") == (a1, 0)  # merged back: rows 0..7 free again
    first = set(arenas.names())
    arenas.give(big, 0, 25)  # emptied, not the only arena: unlinked
    del big
    assert len(arenas.names()) == len(first) - 1
    assert sorted(os.listdir(tmp_path)) == sorted(arenas.names())
    with pytest.raises(OSError):
        RowArenas(ShmBuffers("/proc"), 1 << 20, 1).take(1, 4, "float32")
    buffers.close()


# vLLM's EngineCore, as far as the arenas go: a process that a parent started with multiprocessing (spawn), whose
# scheduler-side fetcher has staged a range in an arena in argv[1]; the parent prints the arena's name, SIGKILLs
# the child (what vLLM's API server does at shutdown with --shutdown-timeout 0) and reports the file still there.
ENGINE = """
import multiprocessing, os, signal, sys, time
from encoder_service.integrations.vllm.fetch import RowFetcher
from encoder_service.integrations.vllm.options import ConnectorOptions

def engine_core(directory, names):
    fetcher = RowFetcher(ConnectorOptions("http://127.0.0.1:1", shm_dir=directory))
    arena, _ = fetcher.arenas.take(16, 8, "float32")
    names.put(arena.name)
    time.sleep(120)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    names = ctx.Queue()
    child = ctx.Process(target=engine_core, args=(sys.argv[1], names))
    child.start()
    name = names.get(timeout=60)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    print(name, os.path.exists(os.path.join(sys.argv[1], name)), flush=True)
"""


def killed_engine_core(tmp_path, directory: str) -> str:
    """Runs ENGINE (its parent exits once the child is killed); the arena's name, which the kill left."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    out = subprocess.run([sys.executable, str(script), directory], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out[1] == "True", out  # killed, nothing closed: the file stayed
    return out[0]


def test_a_killed_engine_cores_arena_is_swept_at_the_next_start(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    name = killed_engine_core(tmp_path, str(shm_dir))
    assert os.listdir(shm_dir) == [name]  # not /dev/shm: the resource tracker can't unlink it
    fetcher = RowFetcher(ConnectorOptions("http://127.0.0.1:1", shm_dir=str(shm_dir)))  # the next start
    assert os.listdir(shm_dir) == []
    fetcher.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_killed_engine_cores_arena_in_dev_shm_goes_when_its_server_exits(tmp_path):
    """In /dev/shm the arena is the resource tracker's: it goes once the killed process's parent has exited
    (the tracker exits after it: a bounded wait), with no new start needed."""
    name = killed_engine_core(tmp_path, "/dev/shm")
    wait_for(lambda: not os.path.exists(os.path.join("/dev/shm", name)), f"/dev/shm/{name} to go", 30, poll_s=0.05)
