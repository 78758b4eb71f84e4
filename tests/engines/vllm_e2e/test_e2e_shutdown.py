"""The language-only servers stop as a container runtime stops them (SIGTERM to the API server; vLLM's default
shutdown then SIGKILLs its engine core, where the connector's staging files are) and leave no staging file
in /dev/shm: the resource tracker of vLLM's API server unlinks them (integrations/vllm/arenas.py). Runs last:
it stops the servers."""

from __future__ import annotations

import pytest

from tests.support.engine_tier import require

require("vllm.entrypoints.openai.api_server", "scripts/tiers/vllm-e2e.sh")

from tests.support.vllm_e2e import SHM_DIR, staging_files  # noqa: E402
from tests.support.waits import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(1500)  # the first test waits for the servers (READY_S)


def test_no_staging_file_is_left(stack):
    lanes = (stack.http, stack.grpc)
    pids = set().union(*(lane.pids for lane in lanes))
    staged = staging_files(SHM_DIR, pids)
    assert len(staged) >= len(lanes), staged  # each lane's engine core staged rows in an arena
    for lane in lanes:
        lane.vllm.stop()
        log = lane.vllm.log_path.read_text(errors="replace")
        assert "force killing remaining process EngineCore" in log, lane.vllm.log_tail()  # vLLM's default
    # the tracker unlinks them as it exits, just after its API server
    wait_for(lambda: staging_files(SHM_DIR, pids) == [],
             lambda: f"staging files unlinked: {staging_files(SHM_DIR, pids)}", 30, poll_s=0.1)
