"""A client's shared-memory files outlive a process that is killed (client/shm.py): their names say who made
them, and the next client that opens the directory removes those of processes that have ended, and nothing
else (a live process's files, names made elsewhere, other files)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from encoder_service.client.shm import PREFIX, ShmBuffers, new_file_name, owner_tag, sweep

# A process that makes one file in the directory argv[1] (ShmBuffers.alloc_rows, as the vLLM connector's
# arenas do), prints its name and waits to be killed.
HOLDER = ("import sys, time; from encoder_service.client.shm import ShmBuffers; b = ShmBuffers(sys.argv[1]); "
          "rows = b.alloc_rows(64, 8, 'float32'); print(b.files()[0], flush=True); time.sleep(120)")


def holder(directory) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_names_carry_their_owner():
    tag = owner_tag()
    assert tag is not None and len(tag) == 24 and int(tag[8:14], 16) == os.getpid()
    name = new_file_name()
    assert name.startswith(PREFIX + tag) and len(name) == len(PREFIX) + 32 and name != new_file_name()


def test_a_killed_processs_file_goes_at_the_next_start(tmp_path):
    killed, name = holder(tmp_path)
    live, live_name = holder(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)  # no close, no finalizer: the file stays
        killed.wait(30)
        tag = owner_tag()
        reused = PREFIX + tag[:14] + "0" * 10 + "0" * 8  # our pid, but a process that started at another time
        foreign = PREFIX + "0" * 8 + tag[8:] + "0" * 8  # another pid namespace's: its pid means nothing here
        for other in (reused, foreign, "other-file"):
            (tmp_path / other).write_bytes(b"")
        assert name in os.listdir(tmp_path)
        buffers = ShmBuffers(str(tmp_path))  # the next start
        assert sorted(os.listdir(tmp_path)) == sorted([live_name, foreign, "other-file"])
        assert sweep(str(tmp_path)) == []
        buffers.close()
    finally:
        live.kill()
        live.wait(30)
    assert sweep(str(tmp_path)) == [live_name]
