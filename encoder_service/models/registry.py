"""From a checkpoint's config.json to a family: its frozen vision config and its tower class."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from encoder_service.errors import ModelLoadError
from encoder_service.models.configs import MLP_PAD_MULTIPLE, VisionConfig, vision_config
from encoder_service.models.layers import VisionTower
from encoder_service.models.qwen2_5_vl import Qwen2_5VLTower
from encoder_service.models.qwen2_vl import Qwen2VLTower
from encoder_service.models.qwen3_vl import Qwen3VLTower


@dataclass(frozen=True)
class Family:
    name: str  # spec.FAMILIES
    tower_cls: type[VisionTower]


FAMILIES = {f.name: f for f in (Family("qwen2_vl", Qwen2VLTower), Family("qwen2_5_vl", Qwen2_5VLTower),
                                 Family("qwen3_vl", Qwen3VLTower))}


@dataclass(frozen=True)
class ResolvedModel:
    family: Family
    config: VisionConfig

    def build_tower(self, mlp_pad_multiple: int = MLP_PAD_MULTIPLE) -> VisionTower:
        """The family's tower, its MLP width padded to a multiple of mlp_pad_multiple (1: as stored)."""
        return self.family.tower_cls(dataclasses.replace(self.config, mlp_pad_multiple=mlp_pad_multiple))


def resolve(config_json: dict) -> ResolvedModel:
    """The family and vision config of a checkpoint (configs.py: vision_config); ModelLoadError if it is not a
    supported Qwen-VL."""
    config = vision_config(config_json)
    _check_llm_width(config_json, config.out_hidden_size)
    return ResolvedModel(FAMILIES[config.FAMILY], config)


def _check_llm_width(config_json: dict, out_hidden_size: int) -> None:
    """The merger must emit the LLM's hidden size (text_config, or the top level in older flat configs)."""
    text_config = config_json.get("text_config") or {}
    llm_width = text_config.get("hidden_size", config_json.get("hidden_size"))
    if llm_width is not None and int(llm_width) != out_hidden_size:
        raise ModelLoadError(
            f"config.json: the vision tower emits {out_hidden_size}-wide embeddings but the language model's "
            f"hidden_size is {llm_width}"
        )
