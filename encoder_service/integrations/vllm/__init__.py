"""vLLM integration: an EC connector that feeds vLLM's encoder cache from encoder_service (images and videos),
and a chat front end.

vLLM is an optional extra (`pip install -e '.[vllm]'` in a checkout of this repository): this package imports
without it; vLLM is imported only when the connector class is used (vLLM's factory does
`getattr(module, "EncoderServiceConnector")`).

  connector.py  EncoderServiceConnector (vLLM's ECConnectorBase, role ec_consumer): a thin adapter over
                the vLLM-free machinery below (benchmarks/connector_bench.py drives that directly)
  options.py    ConnectorOptions: `ec_connector_extra_config`
  staging.py    scheduler side: StagingTable, the books (what is staged for whom, fetch ahead, each step's loads)
  fetch.py      scheduler side: RowFetcher, an item's rows from the encoder into an arena (shm or a socket); a
                video's: all its frame groups' rows, group after group (vLLM caches a video as one item)
  arenas.py     scheduler side: RowArenas, ranges of rows in a few large shared-memory files
  worker.py     worker side: ShmRows / IpcRows / ItemLoad (where staged rows are, or that they are held on the
                encoder's GPU), RowLoader (their copy to the device)
  ipc_loads.py  worker side: IpcLoader, rows held on the encoder's GPU copied GPU to GPU (CUDA IPC)
  proxy.py      `encoder-service vllm-proxy`: OpenAI chat requests -> our encode -> vLLM with metadata-only
                image_embeds / video_embeds parts whose uuid is our id (a video's: its grid and what its
                family's prompt and M-RoPE need besides, `video_metadata`)

On the vLLM prefill/decode instance:

    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --ec-transfer-config "$(python -c 'import json; \
        from encoder_service.integrations.vllm import ec_transfer_config; \
        print(json.dumps(ec_transfer_config("http://encoder:8000", auth_token="...")))')"

docs/vllm.md has the whole deployment.

Where the rows go, and why
--------------------------
vLLM runs the scheduler-side connector in the EngineCore process and one worker-side connector per worker
(TP rank), usually in other processes; the scheduler side can hand a worker only what it puts into the
step's metadata (pickled by vLLM). We follow vLLM's own ECCPUConnector (a shared region the scheduler owns
and the workers map): the scheduler side fetches rows into host shared memory ahead of need and keeps the
books; each worker maps the same memory and copies to its device.

  scheduler side (EngineCore)                                  worker side (each TP rank)
  ensure_cache_available: item not staged -> its fetch         start_load_caches: rows of each load
    starts on a thread; the request is deferred                  (arena file, offset, rows x width)
  fetch: rows [0, n + 1) of the item into a range of an          checked against vLLM's plan, copied to
    arena (a large file of ours in /dev/shm):                    the device -> encoder_cache[identifier]
    - shm: the encoder (same host, --shm-fetch) writes the       (model dtype)
      rows there itself: no socket;
    - socket (HTTP or gRPC): our client writes what the
      socket brings there.
  has_cache_item: staged? (a dict lookup)
  update_state_after_alloc: queue the item's load -> the step's metadata

With `ipc` (the encoder on this host with a device row arena, the workers on CUDA) the fetch is a fetch by
IPC with a hold: nothing is staged in host memory; the hold (the arena's handle, where each frame group's
rows sit, a deadline) rides in the step's metadata, each worker copies the rows GPU to GPU under it with no
request of its own and reports the hold's token in vLLM's worker metadata (gathered from every rank before
the scheduler side sees it), and the scheduler side acknowledges it (ipc_loads.py has the details and the
fallbacks).

So no hook waits on the network: the scheduler answers from a dict, a worker only copies rows already in host
memory, and every TP rank reads the same host copy. The arena is the carrier in both modes (only who writes
it changes), so the worker's side is one path. Arenas are reused item after item, so the encoder keeps them
mapped (its pages are faulted in once) and so does each worker (registered with CUDA: the copy is a DMA).

Checks (a bad item fails its request, through `take_failed` -> vLLM's take_unavailable_requests; vLLM is
never handed a wrong tensor): the encoder's row width against the model's (models/configs.py: `row_width`;
Qwen3-VL rows are `out_hidden * (1 + deepstack levels)`), once per encoder; the item's row count against
what vLLM planned for its placeholder (the fetch asks for one row more than planned, so an item with more
rows is caught too); a row dtype we know. The worker checks the staged shape against the plan again before copying.

Memory: an item's range is held while vLLM holds the item in its encoder cache (until the scheduler output's
`free_encoder_mm_hashes` names it: bounded by vLLM's own encoder cache size) or while a request that needs it
waits to be scheduled; fetches ahead of need start only while the bytes staged and not yet taken by vLLM stay
under `max_staged_bytes` (one fetch always may). Arenas that empty are unlinked (one is kept), all at close.
"""

from __future__ import annotations

from encoder_service.integrations.vllm.options import ConnectorOptions

CONNECTOR = "EncoderServiceConnector"
MODULE = "encoder_service.integrations.vllm"
PARAMS_KEY = "encoder_service"  # request.ec_transfer_params[PARAMS_KEY] = {"ids": [our id of each item, in order]}


def ec_transfer_config(url: str, **extra) -> dict:
    """vLLM's `--ec-transfer-config` for this connector: `url` of the encoder (http://... or grpc://...) plus
    `ec_connector_extra_config` options (options.py: ConnectorOptions), checked here."""
    extra_config = {"url": url, **{k: v for k, v in extra.items() if v is not None}}
    ConnectorOptions.from_extra_config(extra_config)  # ValueError now rather than in vLLM's engine
    return {"ec_connector": CONNECTOR, "ec_role": "ec_consumer", "ec_connector_module_path": MODULE,
            "ec_connector_extra_config": extra_config}


def __getattr__(name: str):
    if name in (CONNECTOR, "EncoderServiceMetadata"):
        try:
            from encoder_service.integrations.vllm import connector
        except ImportError as exc:
            if exc.name is not None and exc.name.split(".")[0] == "vllm":
                raise ImportError(f"{MODULE}.{name} needs vLLM: pip install -e '.[vllm]' in a checkout of "
                                  f"encoder_service ({exc})") from exc
            raise
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONNECTOR", "MODULE", "PARAMS_KEY", "ec_transfer_config", "EncoderServiceConnector"]
