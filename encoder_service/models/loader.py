"""load_model: a checkpoint (local dir or hub id) -> a ready vision tower, reading only the vision tensors.

Steps: resolve the family from config.json (registry.py), build the tower on the meta device (no
allocation; its MLPs at the padded width, configs.py: MLP_PAD_MULTIPLE), find the shards that hold
`visual.` / `model.visual.` tensors (model.safetensors.index.json, or the single model.safetensors), read
just those keys with safetensors.safe_open, check their names and shapes against the checkpoint layout
(checkpoint_layout.py: the shapes as stored; missing / unexpected / mis-shaped -> ModelLoadError listing
them), copy each into its place in zero-filled parameters on the target device and dtype (the one step
where weights change form: the conv becomes a Linear, the MLP width is zero-padded, Qwen2.5's gate and up
are merged), and assign them.

From the hub only config.json, preprocessor_config.json, the index and the shards holding vision tensors
are downloaded. The fingerprint hashes config.json and every vision tensor's raw bytes as stored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import errors as hub_errors
from safetensors import safe_open

from encoder_service.errors import ModelLoadError
from encoder_service.models.checkpoint_layout import Stored, checkpoint_layout
from encoder_service.models.configs import MLP_PAD_MULTIPLE
from encoder_service.models.layers import VisionTower
from encoder_service.models.registry import resolve
from encoder_service.models.spec import VisionSpec

VISION_PREFIXES = ("model.visual.", "visual.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# "This file is not in the repo" (older huggingface_hub: EntryNotFoundError).
_REMOTE_ENTRY_NOT_FOUND = getattr(hub_errors, "RemoteEntryNotFoundError", hub_errors.EntryNotFoundError)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    tower: VisionTower
    spec: VisionSpec
    checkpoint_dir: Path  # holds config.json and preprocessor_config.json
    fingerprint: str
    device: torch.device
    dtype: torch.dtype


def load_model(
    model: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    revision: str | None = None,
    mlp_pad_multiple: int = MLP_PAD_MULTIPLE,
) -> LoadedModel:
    """`model`: a checkpoint directory or a hub id. device: cuda if available else cpu. dtype: bfloat16 on
    CUDA, float32 on CPU. mlp_pad_multiple: 1 builds the MLPs at the checkpoint's width."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _resolve_dtype(dtype, device)
    checkpoint = _LocalCheckpoint(Path(model)) if Path(model).is_dir() else _HubCheckpoint(str(model), revision)

    config_bytes = checkpoint.file("config.json").read_bytes()
    resolved = resolve(json.loads(config_bytes))
    with torch.device("meta"):
        tower = resolved.build_tower(mlp_pad_multiple)

    tensors = _read_vision_tensors(checkpoint)
    layout = checkpoint_layout(tower)
    _check_layout(tensors, {name: stored.shape for name, stored in layout.items()})
    tower.load_state_dict(_parameters(tower, layout, tensors, device, dtype), strict=True, assign=True)
    tower.eval().requires_grad_(False)

    checkpoint.file("preprocessor_config.json")  # fetched now so checkpoint_dir is complete
    return LoadedModel(
        tower=tower,
        spec=resolved.config.spec(),
        checkpoint_dir=checkpoint.directory,
        fingerprint=_fingerprint(config_bytes, tensors),
        device=device,
        dtype=dtype,
    )


def _parameters(
    tower: VisionTower, layout: dict[str, Stored], tensors: dict[str, torch.Tensor], device, dtype
) -> dict[str, torch.Tensor]:
    """The tower's parameters on `device` in `dtype`: zeros, each checkpoint tensor copied into its view."""
    params = {name: torch.zeros(p.shape, device=device, dtype=dtype) for name, p in tower.named_parameters()}
    for name, tensor in tensors.items():
        stored = layout[name]
        stored.view(params[stored.param]).copy_(tensor)
    return params


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# ---- where the files come from -------------------------------------------------------------------


class _LocalCheckpoint:
    def __init__(self, directory: Path):
        self.directory = directory

    def file(self, name: str) -> Path:
        path = self.directory / name
        if not path.is_file():
            raise ModelLoadError(f"checkpoint {self.directory} has no {name}")
        return path

    def has(self, name: str) -> bool:
        return (self.directory / name).is_file()


class _HubCheckpoint:
    """Downloads single files on demand into the hub cache (all land in one snapshot directory)."""

    def __init__(self, repo_id: str, revision: str | None):
        self.repo_id, self.revision = repo_id, revision
        self.directory = self.file("config.json").parent

    def file(self, name: str) -> Path:
        try:
            return self._download(name)
        except _REMOTE_ENTRY_NOT_FOUND as e:
            raise ModelLoadError(f"{self.repo_id} (revision {self.revision}) has no {name}") from e
        except (OSError, ValueError) as e:  # hub HTTP errors, offline, invalid repo id
            raise ModelLoadError(f"cannot load {self.repo_id!r}: not a local directory, and the hub said: {e}") from e

    def has(self, name: str) -> bool:
        try:
            self._download(name)
        except _REMOTE_ENTRY_NOT_FOUND:
            return False
        return True

    def _download(self, name: str) -> Path:
        return Path(huggingface_hub.hf_hub_download(self.repo_id, name, revision=self.revision))


# ---- reading and checking the vision tensors ----------------------------------------------------


def _vision_name(key: str) -> str | None:
    """Tensor name inside the tower for a checkpoint key, or None for a non-vision key."""
    for prefix in VISION_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def _read_vision_tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Open only the shards that hold vision keys; read only those keys."""
    if checkpoint.has(INDEX_FILE):
        weight_map = json.loads(checkpoint.file(INDEX_FILE).read_text())["weight_map"]
        shards: dict[str, list[str] | None] = {}
        for key, shard in weight_map.items():
            if _vision_name(key) is not None:
                shards.setdefault(shard, []).append(key)
    elif checkpoint.has(SINGLE_FILE):
        shards = {SINGLE_FILE: None}  # its vision keys are listed by the file itself
    else:
        raise ModelLoadError(f"checkpoint {checkpoint.directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")

    tensors: dict[str, torch.Tensor] = {}
    for shard, keys in shards.items():
        with safe_open(checkpoint.file(shard), framework="pt") as f:
            for key in keys if keys is not None else [k for k in f.keys() if _vision_name(k) is not None]:
                tensors[_vision_name(key)] = f.get_tensor(key)
    if not tensors:
        prefixes = " or ".join(p + "*" for p in VISION_PREFIXES)
        raise ModelLoadError(f"checkpoint {checkpoint.directory} holds no vision weights (no tensor named {prefixes})")
    return tensors


def _fingerprint(config_bytes: bytes, tensors: dict[str, torch.Tensor]) -> str:
    """Hash of config.json and each vision tensor's name, dtype, shape and raw bytes, in name order (so
    the same weights sharded differently give the same fingerprint)."""
    try:
        import xxhash

        hasher = xxhash.xxh3_128()
    except ImportError:
        hasher = hashlib.blake2b(digest_size=16)
    hasher.update(config_bytes)
    for name in sorted(tensors):
        tensor = tensors[name]
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        hasher.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _check_layout(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    misshaped = sorted(
        f"{name} {tuple(tensors[name].shape)} (expected {expected[name]})"
        for name in expected.keys() & tensors.keys()
        if tuple(tensors[name].shape) != expected[name]
    )
    problems = [
        f"{label} ({len(names)}): {', '.join(names)}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
        if names
    ]
    if problems:
        raise ModelLoadError("vision weights do not match config.json: " + "; ".join(problems))
