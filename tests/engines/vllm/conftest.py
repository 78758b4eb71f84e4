"""vLLM tier fixtures (scripts/tiers/vllm.sh runs this directory in .venv-vllm; elsewhere its tests skip).
The helpers are in tests/support/vllm_engine.py.

  - `encoders`: our real service, one process per family (tiny Qwen2.5-VL, tiny Qwen3-VL), started with the
    command of docs/vllm.md from the main venv. Session scope, started in parallel.
  - `checkpoints`: those checkpoints, with a tokenizer (testing/tiny.py: add_tiny_tokenizer), which vLLM's
    front end needs.
  - `vllm_instance(checkpoint, ec_config, **kw)`: a `VllmInstance`, closed after the test.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.vllm_engine import FAMILIES, EncoderProcess, VllmInstance


@pytest.fixture(scope="session")
def shm_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from encoder_service.testing.tiny import add_tiny_tokenizer, build_tiny_checkpoint

    root = tmp_path_factory.mktemp("vllm_checkpoints")
    return {f: add_tiny_tokenizer(build_tiny_checkpoint(f, root / f)) for f in FAMILIES}


@pytest.fixture(scope="session")
def encoders(checkpoints, shm_dir, tmp_path_factory) -> dict[str, EncoderProcess]:
    logs = tmp_path_factory.mktemp("encoder_logs")
    # Qwen2.5-VL's cache is small (tiny rows are ~12 KB an image) so a test can evict an id.
    extra = {"qwen2_5_vl": ("--cache-bytes", "1MiB", "--max-pinned-bytes", "512KiB")}
    procs = {f: EncoderProcess(checkpoints[f], shm_dir, logs / f"{f}.log", *extra.get(f, ())) for f in FAMILIES}
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(EncoderProcess.wait_ready, procs.values()))
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture
def vllm_instance():
    """`vllm_instance(checkpoint, ec_config, **kw) -> VllmInstance`, closed after the test."""
    made = []

    def make(*args, **kw) -> VllmInstance:
        made.append(VllmInstance(*args, **kw))
        return made[-1]

    yield make
    for inst in made:
        inst.close()
