"""The vLLM tier's helpers (tests/engines/vllm/): our encoder as a subprocess of the main venv, started with the
documented command; vLLM's own objects around a stand-in model runner. Nothing here imports vLLM until used.

  - `EncoderProcess(checkpoint, shm_dir, log, *extra, ports=None)`: `encoder-service serve` with the flags of
    docs/vllm.md, this test's ports (free ones unless given), model, token and shared-memory dir
    (encoder_process.py: run by the main venv on this checkout's code; `wait_ready()`, `stop()`), and
    `client()`.
  - `ProxyProcess(encoder_url, vllm_url, log, api_key)`: `encoder-service vllm-proxy`, the documented command
    with this test's URLs, port, token and callers' key; `.url`.
  - `ec_config(url, **options)`: the documented --ec-transfer-config with this test's URL and token.
  - `VllmInstance(checkpoint, ec_config)`: what a vLLM prefill/decode instance runs around the model, on CPU,
    all vLLM's own objects: VllmConfig, the chat front end (ChatCompletionRequest -> OnlineRenderer ->
    InputProcessor -> Request), the Scheduler (it creates the scheduler-side connector through vLLM's
    factory) and the worker-side connector wrapper (ensure_ec_transfer_initialized +
    ECConnectorModelRunnerMixin) around a stand-in for the model runner's step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.encoder_process import ServiceProcess, encoder_service_argv
from tests.support.ports import free_port
from tests.support.waits import wait_for

TOKEN = "tier-token-42"
FAMILIES = ("qwen2_5_vl", "qwen3_vl")


class EncoderProcess(ServiceProcess):
    """`encoder-service serve` (the documented command, our ports and model) in a subprocess."""

    def __init__(self, checkpoint: Path, shm_dir: Path, log_path: Path, *extra: str,
                 ports: tuple[int, int] | None = None):
        from tests.support.vllm_docs import documented

        self.http_port, self.grpc_port = ports or (free_port(), free_port())
        argv = documented("encoder").replaced({
            "--model": str(checkpoint), "--http-port": str(self.http_port), "--grpc-port": str(self.grpc_port),
            "--auth-token": TOKEN})
        argv += ["--device", "cpu", "--shm-dir", str(shm_dir), "--log-level", "warning", *extra]
        self.url, self.grpc = f"http://127.0.0.1:{self.http_port}", f"127.0.0.1:{self.grpc_port}"
        super().__init__(encoder_service_argv(*argv[1:]), self.url + "/health/ready", log_path,
                         name=f"encoder ({checkpoint.name})")

    def client(self, transport: str = "http"):
        from encoder_service.client import EncoderClient

        return EncoderClient.http(self.url, token=TOKEN) if transport == "http" else \
            EncoderClient.grpc(self.grpc, token=TOKEN)


class ProxyProcess(ServiceProcess):
    """`encoder-service vllm-proxy` (the documented command, our URLs and port) in a subprocess."""

    def __init__(self, encoder_url: str, vllm_url: str, log_path: Path, api_key: str):
        from tests.support.vllm_docs import documented

        port = free_port()
        argv = documented("proxy").replaced({"--encoder-url": encoder_url, "--vllm-url": vllm_url,
                                             "--host": "127.0.0.1", "--port": str(port), "--auth-token": TOKEN,
                                             "--api-key": api_key})
        self.url = f"http://127.0.0.1:{port}"
        super().__init__(encoder_service_argv(*argv[1:]), self.url + "/health", log_path, name="vllm-proxy")


def ec_config(url: str, **extra) -> dict:
    """The documented --ec-transfer-config with this test's encoder URL and token (plus extra options)."""
    from tests.support.vllm_docs import DOC_TOKEN, DOC_URL, doc_ec_transfer_config

    config = doc_ec_transfer_config()
    options = config["ec_connector_extra_config"]
    assert (options["url"], options["auth_token"]) == (DOC_URL, DOC_TOKEN)
    options.update(url=url, auth_token=TOKEN, arena_bytes="256KiB", **extra)
    return config


class VllmInstance:
    """vLLM's front end, scheduler and worker-side connector for one (checkpoint, --ec-transfer-config)."""

    def __init__(self, checkpoint: Path, ec_transfer_config: dict, *, trust_request_mm_kwargs: bool = False):
        import torch
        from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, get_ec_transfer
        from vllm.distributed.ec_transfer.ec_transfer_state import ensure_ec_transfer_shutdown
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.model_config = ModelConfig(model=str(checkpoint), dtype="float32", max_model_len=1024,
                                        enforce_eager=True)
        self.config = VllmConfig(model_config=self.model_config,
                                 ec_transfer_config=ECTransferConfig(**ec_transfer_config))
        renderer = renderer_from_config(self.config)
        self.front = OnlineRenderer(self.model_config, renderer, request_logger=None, chat_template=None,
                                    chat_template_content_format="auto",
                                    trust_request_mm_kwargs=trust_request_mm_kwargs)
        self.input_processor = InputProcessor(self.config, renderer)
        self.config.cache_config.num_gpu_blocks = 256
        kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer.0"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32))])
        self.scheduler = Scheduler(self.config, kv, StructuredOutputManager(self.config), block_size=16)
        ensure_ec_transfer_shutdown()  # one worker connector per process: this instance's
        ensure_ec_transfer_initialized(self.config)
        self.worker = get_ec_transfer()
        self.connector = self.scheduler.ec_connector
        self.encoder_cache: dict = {}  # the model runner's encoder_cache
        self.local_encodes: dict[str, list[int]] = {}  # what vLLM would have encoded itself (must stay empty)
        self.gathered: dict[str, object] = {}  # identifier -> the tensor the model would have read
        self.finish: dict[str, str] = {}  # request id -> finish reason

    def request(self, request_id: str, body: dict):
        """An OpenAI chat request body through vLLM's own front end -> a scheduler Request."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.v1.request import Request

        chat = ChatCompletionRequest.model_validate(body)
        rendered = asyncio.run(self.front.render_chat(chat))
        if isinstance(rendered, ErrorResponse):
            raise ValueError(rendered.error.message)
        _, (engine_input,) = rendered
        params = chat.to_sampling_params(chat.max_completion_tokens or 2, {})
        ecr = self.input_processor.process_inputs(request_id, engine_input, params, supported_tasks=("generate",))
        return Request.from_engine_core_request(ecr, block_hasher=None)

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

        out = self.scheduler.schedule()
        before = {rid: self.scheduler.requests[rid].num_computed_tokens - n
                  for rid, n in out.num_scheduled_tokens.items()}
        for h in out.free_encoder_mm_hashes:  # GPUModelRunner._update_states
            self.encoder_cache.pop(h, None)
        ec_out = None
        if out.total_num_scheduled_tokens > 0:  # the V1 runner skips the connector on empty steps
            with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(out, self.encoder_cache) as ec_out:
                for rid, inputs in out.scheduled_encoder_inputs.items():
                    self.local_encodes.setdefault(rid, []).extend(inputs)
                self._gather(out, before)
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[7] if self.scheduler.requests[r].num_computed_tokens >= self.scheduler.requests[r].num_prompt_tokens
                   else [] for r in req_ids]
        outputs = self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            ec_connector_output=ec_out))
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finish[o.request_id] = str(o.finish_reason)

    def _gather(self, out, before: dict[str, int]) -> None:
        """What GPUModelRunner._gather_mm_embeddings reads: each scheduled item's encoder_cache entry."""
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            for f in req.mm_features:
                pos = f.mm_position
                if pos.offset < before[rid] + n and before[rid] < pos.offset + pos.length:
                    if f.identifier not in self.encoder_cache:
                        raise AssertionError(f"Encoder cache miss for {f.identifier} (vLLM would raise)")
                    self.gathered[f.identifier] = self.encoder_cache[f.identifier]

    def run(self, requests: list, timeout_s: float = 60.0) -> dict[str, str]:
        """Add `requests`, step until all have finished; {request id: finish reason}."""
        for r in requests:
            self.scheduler.add_request(r)
        wanted = {r.request_id for r in requests}

        def finished() -> bool:  # one step of the engine loop; fetches complete on the connector's threads between
            if wanted <= set(self.finish):
                return True
            self.step()
            return False

        wait_for(finished, lambda: f"requests finished: {sorted(wanted - set(self.finish))}", timeout_s, poll_s=0.005)
        return {r: self.finish[r] for r in sorted(wanted)}

    def close(self) -> None:
        from vllm.distributed.ec_transfer.ec_transfer_state import ensure_ec_transfer_shutdown

        self.connector.shutdown()
        ensure_ec_transfer_shutdown()
