"""vllm-e2e tier fixtures (scripts/tiers/vllm-e2e.sh runs this directory in .venv-vllm-e2e; elsewhere its tests
skip). Everything runs as deployed, in processes of its own, started once for the whole tier run (`stack`,
session scope, everything started at once and then waited for: each vLLM server takes about a minute):

  - our encoder service on the tiny checkpoint (the main venv; tests/support/vllm_engine.py: EncoderProcess),
    serving shared-memory fetches in /dev/shm, with a small cache so that a test can evict an id;
  - `aggregated`: a vLLM server that encodes images itself (its own Qwen2.5-VL vision tower);
  - two lanes, each a language-only vLLM server with our connector and an `encoder-service vllm-proxy` in front:
    `http` (the connector fetches over HTTP and takes the rows through shared memory; the proxy encodes over
    HTTP; vLLM's worker is a process of its own, as with tensor parallelism) and `grpc` (gRPC, shm off, both;
    the worker runs in the engine core's process, as on one GPU).
    The aggregated server's worker is in its engine core's process too (`--distributed-executor-backend
    uni`): two processes less to start.
  - `other`: a checkpoint whose vision tower has other weights (another seed), for the encoder to swap to.

Helpers: tests/support/vllm_e2e.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.encoder_process import ServiceProcess, encoder_service_argv
from tests.support.ports import free_port
from tests.support.vllm_docs import documented
from tests.support.vllm_e2e import (
    CALLER,
    DOWN_TIMEOUT_S,
    FETCH_TIMEOUT_S,
    PROXY_TIMEOUT_S,
    READY_S,
    SHM_DIR,
    VllmServer,
    build_checkpoint,
)
from tests.support.vllm_engine import TOKEN, EncoderProcess, ec_config

# Rows are 64 float32 per token, about 3 KB an image here: 256 KiB holds some 80 images.
ENCODER_FLAGS = ("--cache-bytes", "256KiB", "--max-pinned-bytes", "128KiB")
UNI = ("--distributed-executor-backend", "uni")  # vLLM's worker in its engine core's process



@dataclass
class Lane:
    """A language-only vLLM server with our connector, and the proxy in front of it."""

    vllm: VllmServer
    proxy: ServiceProcess
    proxy_url: str
    quick_proxy: ServiceProcess  # the same with --timeout-s DOWN_TIMEOUT_S: its 503 for a down encoder comes sooner
    quick_proxy_url: str
    pids: set[int] | None = None  # the vLLM server's processes once it is up


@dataclass
class Stack:
    checkpoint: Path
    other: Path  # another seed: other vision weights
    logs: Path
    encoder: EncoderProcess
    aggregated: VllmServer
    http: Lane
    grpc: Lane

    def restart_encoder(self, checkpoint: Path | None) -> None:
        """Stop the encoder; with a checkpoint, start it again on that one, on the same ports."""
        self.encoder.stop()
        if checkpoint is not None:
            self.encoder = EncoderProcess(checkpoint, SHM_DIR, self.logs / f"encoder-{checkpoint.name}.log",
                                          *ENCODER_FLAGS, ports=(self.encoder.http_port, self.encoder.grpc_port))
            self.encoder.wait_ready(120)

    def processes(self) -> list[ServiceProcess]:
        return [self.http.proxy, self.grpc.proxy, self.http.quick_proxy, self.grpc.quick_proxy, self.http.vllm,
                self.grpc.vllm, self.aggregated, self.encoder]


def _proxy(encoder_url: str, vllm: VllmServer, log: Path, timeout_s: float = PROXY_TIMEOUT_S
           ) -> tuple[ServiceProcess, str]:
    port = free_port()
    argv = documented("proxy").replaced({
        "--encoder-url": encoder_url, "--vllm-url": vllm.url, "--host": "127.0.0.1", "--port": str(port),
        "--auth-token": TOKEN, "--api-key": CALLER["authorization"].removeprefix("Bearer ")})
    url = f"http://127.0.0.1:{port}"
    argv += ["--timeout-s", str(timeout_s)]
    return ServiceProcess(encoder_service_argv(*argv[1:]), url + "/health", log, name=log.stem), url


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    root = tmp_path_factory.mktemp("vllm_e2e")
    logs = root / "logs"
    logs.mkdir()
    checkpoint, other = build_checkpoint(root / "tiny", seed=0), build_checkpoint(root / "other", seed=1)
    encoder = EncoderProcess(checkpoint, SHM_DIR, logs / "encoder.log", *ENCODER_FLAGS)
    grpc_url = "grpc://" + encoder.grpc
    started = []
    try:
        started.append(encoder)
        aggregated = VllmServer(checkpoint, logs / "vllm-aggregated.log", None, *UNI)
        started.append(aggregated)
        lanes = {}
        for name, url, options, extra in [("http", encoder.url, {}, ()), ("grpc", grpc_url, {"shm": "off"}, UNI)]:
            config = ec_config(url, fetch_timeout_s=FETCH_TIMEOUT_S, **options)
            vllm = VllmServer(checkpoint, logs / f"vllm-{name}.log", config, *extra)
            started.append(vllm)
            proxy, proxy_url = _proxy(url, vllm, logs / f"proxy-{name}.log")
            quick, quick_url = _proxy(url, vllm, logs / f"proxy-{name}-quick.log", DOWN_TIMEOUT_S)
            started += [proxy, quick]
            lanes[name] = Lane(vllm, proxy, proxy_url, quick, quick_url)
        with ThreadPoolExecutor(len(started)) as pool:  # the proxies' /health waits for their vLLM and encoder
            list(pool.map(lambda p: p.wait_ready(READY_S), started))
        for lane in lanes.values():
            lane.pids = lane.vllm.pids()
        stack = Stack(checkpoint, other, logs, encoder, aggregated, lanes["http"], lanes["grpc"])
        yield stack
        started = stack.processes()
    finally:
        for p in started:
            p.stop()
