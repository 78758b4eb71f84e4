"""Frozen vision-tower configs, one per family, read from a checkpoint's config.json.

Every value comes from config.json; a missing required key is a ModelLoadError, never a transformers
class default (those are not real checkpoint values). The two documented exceptions: the vision rope
theta (no checkpoint stores it; 10000 for all Qwen-VL towers) and `in_chans` as an old spelling of
`in_channels`. One value is ours, not the checkpoint's: the padded MLP width the towers are built with
(`intermediate_size_padded`).

`vision_config(config_json)` reads a checkpoint's (its family from `model_type` or `architectures`) and
`row_width(config_json)` is the width of the rows its LLM takes: both import no tower (registry.py adds the
towers), so an LLM server's process can check our rows against its model cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from encoder_service.errors import ModelLoadError
from encoder_service.models.spec import VisionSpec

VISION_ROPE_THETA = 10000.0
# The towers' MLP width I is zero-padded to a multiple of this at load time (models/loader.py). Qwen2.5's
# I = 3420 is not a multiple of 64: its down projection (K = 3420) ran at a quarter of the other GEMMs' rate
# on an H100 (193 TFLOP/s; 704 at K = 3456; benchmarks/RESULTS.md). The padding is exact: the extra
# gate / up / fc1 rows are zero with zero bias, so the extra hidden columns are act(0) * 0 = 0 or act(0) = 0
# (silu, gelu, quick_gelu all map 0 to 0), and the extra down / fc2 columns are zero, so they add exact
# zeros to every dot product.
MLP_PAD_MULTIPLE = 128


def find_multiple(n: int, k: int) -> int:
    """The smallest multiple of k that is >= n."""
    return n if n % k == 0 else n + k - n % k


class _Fields:
    """Reads `vision_config` keys, naming the missing one in the error."""

    def __init__(self, vision_config: dict):
        self.vc = vision_config

    def __call__(self, key: str, *aliases: str):
        for name in (key, *aliases):
            if name in self.vc:
                return self.vc[name]
        raise ModelLoadError(f"config.json: vision_config has no '{key}'")

    def rope_theta(self) -> float:
        rope = self.vc.get("rope_parameters") or {}
        return float(rope.get("rope_theta", VISION_ROPE_THETA))


@dataclass(frozen=True)
class _CommonConfig:
    FAMILY: ClassVar[str]
    model_type: str
    depth: int
    hidden_size: int  # tower width (Qwen2-VL calls it embed_dim)
    num_heads: int
    hidden_act: str
    out_hidden_size: int  # merger output width = LLM hidden size
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    rope_theta: float
    intermediate_size: int  # MLP width as stored in the checkpoint (Qwen2-VL: embed_dim * mlp_ratio)
    # 1: build the towers at the checkpoint's width (tests compare the two).
    mlp_pad_multiple: int = field(default=MLP_PAD_MULTIPLE, kw_only=True)

    @property
    def intermediate_size_padded(self) -> int:
        """The MLP width the towers are built with (see MLP_PAD_MULTIPLE)."""
        return find_multiple(self.intermediate_size, self.mlp_pad_multiple)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def num_deepstack(self) -> int:
        return 0

    def spec(self) -> VisionSpec:
        return VisionSpec(
            family=self.FAMILY,
            model_type=self.model_type,
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size,
            in_channels=self.in_channels,
            out_hidden_size=self.out_hidden_size,
            num_deepstack=self.num_deepstack,
        )


def _common(model_type: str, f: _Fields, hidden_size_key: str, out_hidden_size: int) -> dict:
    return dict(
        model_type=model_type,
        depth=int(f("depth")),
        hidden_size=int(f(hidden_size_key)),
        num_heads=int(f("num_heads")),
        hidden_act=str(f("hidden_act")),
        out_hidden_size=out_hidden_size,
        patch_size=int(f("patch_size", "spatial_patch_size")),
        temporal_patch_size=int(f("temporal_patch_size")),
        merge_size=int(f("spatial_merge_size")),
        in_channels=int(f("in_channels", "in_chans")),
        rope_theta=f.rope_theta(),
    )


@dataclass(frozen=True)
class Qwen2VLConfig(_CommonConfig):
    FAMILY = "qwen2_vl"

    @classmethod
    def from_vision_config(cls, model_type: str, vc: dict) -> Qwen2VLConfig:
        f = _Fields(vc)
        # Qwen2-VL's vision `hidden_size` is the merger output (the LLM width); `embed_dim` is the tower's.
        common = _common(model_type, f, "embed_dim", int(f("hidden_size")))
        return cls(**common, intermediate_size=int(common["hidden_size"] * f("mlp_ratio")))


@dataclass(frozen=True)
class Qwen2_5VLConfig(_CommonConfig):
    FAMILY = "qwen2_5_vl"
    window_size: int  # in pixels: window_size // patch_size // merge_size merged tokens per window side
    fullatt_block_indexes: tuple[int, ...]

    @property
    def window_units(self) -> int:
        return self.window_size // self.merge_size // self.patch_size

    @classmethod
    def from_vision_config(cls, model_type: str, vc: dict) -> Qwen2_5VLConfig:
        f = _Fields(vc)
        return cls(
            **_common(model_type, f, "hidden_size", int(f("out_hidden_size"))),
            intermediate_size=int(f("intermediate_size")),
            window_size=int(f("window_size")),
            fullatt_block_indexes=tuple(int(i) for i in f("fullatt_block_indexes")),
        )


@dataclass(frozen=True)
class Qwen3VLConfig(_CommonConfig):
    FAMILY = "qwen3_vl"
    num_position_embeddings: int  # a square table: pos_embed_side ** 2 rows
    deepstack_visual_indexes: tuple[int, ...]

    @property
    def pos_embed_side(self) -> int:
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_vision_config(cls, model_type: str, vc: dict) -> Qwen3VLConfig:
        f = _Fields(vc)
        return cls(
            **_common(model_type, f, "hidden_size", int(f("out_hidden_size"))),
            intermediate_size=int(f("intermediate_size")),
            num_position_embeddings=int(f("num_position_embeddings")),
            deepstack_visual_indexes=tuple(int(i) for i in f("deepstack_visual_indexes")),
        )

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_visual_indexes)


# config.json `model_type` -> its vision config. Qwen3-VL-MoE's vision tower is Qwen3-VL's.
CONFIGS = {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5VLConfig, "qwen3_vl": Qwen3VLConfig,
           "qwen3_vl_moe": Qwen3VLConfig}
ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}
VisionConfig = Qwen2VLConfig | Qwen2_5VLConfig | Qwen3VLConfig


def model_type(config_json: dict) -> str:
    """The checkpoint's model type (one of CONFIGS), from `model_type` or else `architectures`."""
    found = config_json.get("model_type")
    if found in CONFIGS:
        return found
    architectures = config_json.get("architectures") or []
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ModelLoadError(
        f"unsupported model: config.json has model_type={found!r}, architectures={architectures!r}; "
        f"supported model types: {sorted(CONFIGS)} (architectures {sorted(ARCHITECTURES)})"
    )


def vision_config(config_json: dict) -> VisionConfig:
    """The frozen vision config of a checkpoint's config.json; ModelLoadError if it is not a supported Qwen-VL."""
    found = model_type(config_json)
    vc = config_json.get("vision_config")
    if not isinstance(vc, dict):
        raise ModelLoadError(f"config.json of a {found} model has no vision_config")
    return CONFIGS[found].from_vision_config(found, vc)


def row_width(config_json: dict) -> int:
    """Width of the rows the checkpoint's LLM takes from its vision tower (spec.py: the row layout):
    Qwen2/2.5-VL `out_hidden_size`, Qwen3-VL `out_hidden_size * (1 + len(deepstack_visual_indexes))`."""
    return vision_config(config_json).spec().row_width
