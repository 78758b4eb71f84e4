"""`EncoderServiceConnector`: vLLM's EC-connector interface (`ECConnectorBase`, role ec_consumer) over our
vLLM-free machinery (the package's __init__.py holds the design). Thin on purpose: it turns vLLM's objects (Request,
SchedulerOutput, the worker's encoder_cache) into plain calls.

Scheduler side (EngineCore process)          -> staging.StagingTable
  ensure_cache_available(request, computed)     the request's not-yet-computed items (vLLM identifier, our id,
                                                rows vLLM planned); False (deferred) until all are staged
  has_cache_item(identifier)                    a dict lookup (vLLM asks every step)
  update_state_after_alloc(request, index)      queue that item's load
  build_connector_meta(scheduler_output)        the step's loads; forget what vLLM evicted
  take_unavailable_requests()                   requests whose item can't be had (vLLM fails them)
  request_finished(request)                     release the encoder's pins of its ids
  update_connector_output(output)               acknowledge the IPC holds the workers copied under; a worker may
                                                not open the encoder's IPC memory: stage from now on
Worker side (each worker)                    -> worker.RowLoader
  start_load_caches(encoder_cache)              staged rows -> the worker's device -> encoder_cache[identifier];
                                                rows on the encoder's GPU: copied by IPC (ipc_loads.py)
  build_connector_worker_meta()                 the holds copied under this step; once, that IPC was refused here

Items are images and videos. Our id is the item's `uuid` in the chat request: vLLM keeps a client uuid as the
identifier when the request has no `mm_processor_kwargs` and the server no `--media-io-kwargs` for the item's
modality (and no tower LoRA). Otherwise the identifier is a hash; then the ids must come in
`ec_transfer_params` (the proxy always sends them): `{"encoder_service": {"ids": [id of item 0, ...]}}`, in
the order of the request's items (prompt order, images and videos alike). Without them such a request fails
with a clear error (the hash is unknown to the encoder).

A video is one vLLM item (one identifier, one encoder-cache entry: all its rows) and several of ours: its
frame groups, whose count vLLM has from the part's `video_grid_thw` (`frame_groups`); fetch.py fetches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (ECConnectorBase, ECConnectorMetadata, ECConnectorRole,
                                                             ECConnectorWorkerMetadata)

from encoder_service.integrations.vllm import PARAMS_KEY
from encoder_service.integrations.vllm.fetch import RowFetcher
from encoder_service.integrations.vllm.ipc_loads import IpcLoader
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.staging import Need, StagingTable
from encoder_service.integrations.vllm.worker import ItemLoad, RowLoader
from encoder_service.models import configs
from encoder_service.rowpath.cuda_ipc import KIND as CUDA_IPC

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

MODALITIES = ("image", "video")  # what the encoder service serves


class ItemMapError(ValueError):
    """A request's items can't be mapped to our ids."""


@dataclass
class EncoderServiceMetadata(ECConnectorMetadata):
    """Scheduler -> workers, one per step: the items to load, and the staging files still in use."""

    loads: list[ItemLoad] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


@dataclass
class EncoderServiceWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, one per step when there is news: the tokens of the IPC holds a worker copied
    under this step (vLLM gathers every rank's before the scheduler side sees them: then all ranks' copies are
    done, and the scheduler side acknowledges them), and why a worker may not open the encoder's IPC memory
    (sent once per worker; the scheduler side stages in host memory from then on)."""

    ipc_refused: str | None = None
    copied: list[str] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if isinstance(other, EncoderServiceWorkerMetadata):
            if self.ipc_refused is None:
                self.ipc_refused = other.ipc_refused
            self.copied = list(dict.fromkeys(self.copied + other.copied))
        return self


def item_ids(request: Request) -> list[str]:
    """Our id of each of the request's multimodal items (same order as `request.mm_features`)."""
    features = request.mm_features
    for f in features:
        if f.modality not in MODALITIES:
            raise ItemMapError(f"item {f.identifier!r} is {f.modality}: the encoder service serves images and "
                               "videos only")
    params = (request.ec_transfer_params or {}).get(PARAMS_KEY)
    if params is None:
        return [f.identifier for f in features]
    ids = params.get("ids") if isinstance(params, dict) else None
    if not isinstance(ids, list) or len(ids) != len(features) or not all(isinstance(i, str) for i in ids):
        raise ItemMapError(f"ec_transfer_params[{PARAMS_KEY!r}]['ids'] must list one id per image or video "
                           f"({len(features)}), got {ids!r}")
    return ids


def frame_groups(feature) -> int | None:
    """A video item's frame groups (its video_grid_thw's t, as vLLM parsed it from the request); None for an
    image."""
    if feature.modality != "video":
        return None
    grid = feature.data.get("video_grid_thw") if feature.data is not None else None
    if grid is None:
        raise ItemMapError(f"video {feature.identifier!r} reached the scheduler without its video_grid_thw")
    return int(grid.data[0])


class EncoderServiceConnector(ECConnectorBase):
    """vLLM EC connector (role ec_consumer) that takes image and video embeddings from encoder_service.

    --ec-transfer-config '{"ec_connector": "EncoderServiceConnector", "ec_role": "ec_consumer",
      "ec_connector_module_path": "encoder_service.integrations.vllm",
      "ec_connector_extra_config": {"url": "http://encoder:8000", "auth_token": "..."}}'
    (`encoder_service.integrations.vllm.ec_transfer_config(url, ...)` writes it; options: options.py).
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        if not self.is_consumer or self.is_producer:
            raise ValueError("EncoderServiceConnector is a consumer: set ec_role to \"ec_consumer\" (the encoder "
                             "service is the producer)")
        ec = vllm_config.ec_transfer_config
        self.options = ConnectorOptions.from_extra_config(ec.ec_connector_extra_config)
        model_config = vllm_config.model_config
        self.row_width = configs.row_width(model_config.hf_config.to_dict()) if model_config is not None else None
        self.table: StagingTable | None = None
        self.loader: RowLoader | None = None
        self._told_ipc_refused = False
        if model_config is not None:
            _check_deepstack(model_config)
        if role == ECConnectorRole.SCHEDULER:
            self.table = StagingTable(RowFetcher(self.options, self.row_width, ipc_kind=_worker_ipc_kind()))
        else:
            dtype = model_config.dtype if model_config is not None else None
            device = _worker_device()
            self.loader = RowLoader(device, dtype if isinstance(dtype, torch.dtype) else None,
                                    ipc=IpcLoader(self.options, device) if device.type == "cuda" else None)

    # ---- scheduler side ---------------------------------------------------------------------------------
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        try:
            needs = _needs(request, num_computed_tokens)
        except ItemMapError as exc:
            self.table.fail(request.request_id, str(exc))
            return False
        return self.table.ensure(request.request_id, needs)

    def has_cache_item(self, identifier: str) -> bool:
        return self.table.has(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        self.table.allocated(request.request_id, feature.identifier, request.get_num_encoder_embeds(index))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EncoderServiceMetadata:
        loads = self.table.end_step(scheduler_output.free_encoder_mm_hashes or ())
        return EncoderServiceMetadata(loads, self.table.fetcher.arenas.names())

    def take_unavailable_requests(self) -> set[str]:
        return self.table.take_failed()

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, EncoderServiceWorkerMetadata):
            self.table.fetcher.copied(meta.copied)
            if meta.ipc_refused:
                self.table.fetcher.ipc_refused(meta.ipc_refused)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        try:
            ids = item_ids(request)
        except ItemMapError:
            ids = []
        self.table.finished(request.request_id, ids)
        return False, None

    # ---- worker side ------------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, EncoderServiceMetadata)
        if meta.loads:
            from vllm.utils.gpu_sync_debug import gpu_sync_allowed

            with gpu_sync_allowed():
                for load in meta.loads:
                    if load.identifier not in encoder_cache:
                        encoder_cache[load.identifier] = self.loader.load(load, self.row_width)
        self.loader.retain(meta.files)

    def build_connector_worker_meta(self) -> EncoderServiceWorkerMetadata | None:
        ipc = self.loader.ipc if self.loader is not None else None
        if ipc is None:
            return None
        copied, refused = ipc.take_copied(), ipc.refused
        if self._told_ipc_refused:
            refused = None
        self._told_ipc_refused |= refused is not None
        return EncoderServiceWorkerMetadata(refused, copied) if copied or refused else None

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        pass  # a consumer saves nothing: the encoder service is the producer

    def shutdown(self) -> None:
        if self.table is not None:
            self.table.close()
        if self.loader is not None:
            self.loader.close()


def _needs(request: Request, num_computed_tokens: int) -> list[Need]:
    """The request's items not yet in the KV cache: vLLM's identifier, our id, the rows vLLM planned, and a
    video's frame groups."""
    needs = []
    for index, (feature, item_id) in enumerate(zip(request.mm_features, item_ids(request))):
        pos = feature.mm_position
        if pos.offset + pos.length > num_computed_tokens:
            needs.append(Need(feature.identifier, item_id, request.get_num_encoder_embeds(index),
                              frame_groups(feature)))
    return needs


def _worker_ipc_kind() -> str | None:
    """The IPC memory vLLM's workers can open: CUDA's on a CUDA platform, else none (no fetch by IPC)."""
    from vllm.platforms import current_platform

    return CUDA_IPC if current_platform.is_cuda() else None


def _worker_device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)


def _check_deepstack(model_config) -> None:
    """Qwen3-VL adds the deepstack levels only while its vision tower exists; --limit-mm-per-prompt with
    image 0 removes it, and then our [main | deepstack] rows would not fit the model."""
    vision = getattr(model_config.hf_config, "vision_config", None)
    if not getattr(vision, "deepstack_visual_indexes", None):
        return
    mm = model_config.multimodal_config
    if mm is not None and mm.get_limit_per_prompt("image") == 0:
        raise ValueError("Qwen3-VL with --limit-mm-per-prompt image 0 has no deepstack: keep the image limit > 0 "
                         "on an EncoderServiceConnector instance (the encoder sends [main | deepstack] rows)")
