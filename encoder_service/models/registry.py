"""From a checkpoint's config.json to a family: its frozen vision config and its tower class."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from encoder_service.errors import ModelLoadError
from encoder_service.models.configs import MLP_PAD_MULTIPLE, Qwen2_5VLConfig, Qwen2VLConfig, Qwen3VLConfig
from encoder_service.models.layers import VisionTower
from encoder_service.models.qwen2_5_vl import Qwen2_5VLTower
from encoder_service.models.qwen2_vl import Qwen2VLTower
from encoder_service.models.qwen3_vl import Qwen3VLTower


@dataclass(frozen=True)
class Family:
    name: str  # spec.FAMILIES
    config_cls: type
    tower_cls: type[VisionTower]


_QWEN2_VL = Family("qwen2_vl", Qwen2VLConfig, Qwen2VLTower)
_QWEN2_5_VL = Family("qwen2_5_vl", Qwen2_5VLConfig, Qwen2_5VLTower)
_QWEN3_VL = Family("qwen3_vl", Qwen3VLConfig, Qwen3VLTower)

# config.json `model_type` -> family. Qwen3-VL-MoE's vision tower is Qwen3-VL's.
MODEL_TYPES = {"qwen2_vl": _QWEN2_VL, "qwen2_5_vl": _QWEN2_5_VL, "qwen3_vl": _QWEN3_VL, "qwen3_vl_moe": _QWEN3_VL}
ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}


@dataclass(frozen=True)
class ResolvedModel:
    family: Family
    config: Qwen2VLConfig | Qwen2_5VLConfig | Qwen3VLConfig

    def build_tower(self, mlp_pad_multiple: int = MLP_PAD_MULTIPLE) -> VisionTower:
        """The family's tower, its MLP width padded to a multiple of mlp_pad_multiple (1: as stored)."""
        return self.family.tower_cls(dataclasses.replace(self.config, mlp_pad_multiple=mlp_pad_multiple))


def resolve(config_json: dict) -> ResolvedModel:
    """The family and vision config of a checkpoint; ModelLoadError if it is not a supported Qwen-VL."""
    model_type = _model_type(config_json)
    family = MODEL_TYPES[model_type]
    vision_config = config_json.get("vision_config")
    if not isinstance(vision_config, dict):
        raise ModelLoadError(f"config.json of a {model_type} model has no vision_config")
    config = family.config_cls.from_vision_config(model_type, vision_config)
    _check_llm_width(config_json, config.out_hidden_size)
    return ResolvedModel(family, config)


def _model_type(config_json: dict) -> str:
    model_type = config_json.get("model_type")
    if model_type in MODEL_TYPES:
        return model_type
    architectures = config_json.get("architectures") or []
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ModelLoadError(
        f"unsupported model: config.json has model_type={model_type!r}, architectures={architectures!r}; "
        f"supported model types: {sorted(MODEL_TYPES)} (architectures {sorted(ARCHITECTURES)})"
    )


def _check_llm_width(config_json: dict, out_hidden_size: int) -> None:
    """The merger must emit the LLM's hidden size (text_config, or the top level in older flat configs)."""
    text_config = config_json.get("text_config") or {}
    llm_width = text_config.get("hidden_size", config_json.get("hidden_size"))
    if llm_width is not None and int(llm_width) != out_hidden_size:
        raise ModelLoadError(
            f"config.json: the vision tower emits {out_hidden_size}-wide embeddings but the language model's "
            f"hidden_size is {llm_width}"
        )
