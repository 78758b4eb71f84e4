"""The towers the benchmarks build: transformers' own vision models of Qwen2.5-VL-7B and Qwen3-VL-8B at their
real sizes (or tiny, --small) with random weights, saved as checkpoints our loader reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Real vision configs: the vision_config of Qwen/Qwen2.5-VL-7B-Instruct and Qwen/Qwen3-VL-8B-Instruct.
REAL = {
    "qwen2_5_vl": dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        patch_size=14,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        hidden_act="silu",
    ),
    "qwen3_vl": dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        patch_size=16,
        deepstack_visual_indexes=[8, 16, 24],
        num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
    ),
}
# --small: the same structure, tiny (window of 2x2 merged tokens, 4x4 position table).
SMALL = {
    "qwen2_5_vl": REAL["qwen2_5_vl"]
    | dict(depth=4, hidden_size=64, intermediate_size=72, num_heads=4, out_hidden_size=96)
    | dict(window_size=56, fullatt_block_indexes=[1, 3]),
    "qwen3_vl": REAL["qwen3_vl"]
    | dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=96)
    | dict(deepstack_visual_indexes=[0, 2], num_position_embeddings=16),
}
NAMES = {"qwen2_5_vl": "Qwen2.5-VL-7B", "qwen3_vl": "Qwen3-VL-8B"}

FAMILY_CLASSES = {
    # family: (model_type, architecture, vision config class, vision model class, checkpoint prefix)
    "qwen2_5_vl": (
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig",
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel",
        "visual.",
    ),
    "qwen3_vl": (
        "qwen3_vl",
        "Qwen3VLForConditionalGeneration",
        "transformers.models.qwen3_vl.configuration_qwen3_vl.Qwen3VLVisionConfig",
        "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel",
        "model.visual.",
    ),
}

# Preprocessing of the released checkpoints (their preprocessor_config.json); --small keeps images at most 256
# tokens.
PREPROCESS = {
    "qwen2_5_vl": dict(min_pixels=3136, max_pixels=12845056, image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711]),
    "qwen3_vl": dict(min_pixels=65536, max_pixels=16777216, image_mean=[0.5] * 3, image_std=[0.5] * 3),
}


def _import(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


def patch_grid(width: int, height: int, patch: int) -> tuple[int, int, int]:
    """(t, h, w) of one image resized to the nearest multiples of patch * 2 (smart_resize within bounds)."""
    factor = patch * 2
    resized_height, resized_width = (max(factor, round(x / factor) * factor) for x in (height, width))
    return (1, resized_height // patch, resized_width // patch)


def build_reference(family: str, vision: dict, device: torch.device, dtype: torch.dtype, directory: Path):
    """transformers' vision model with random weights, saved as a vision-only checkpoint in `directory`."""
    model_type, architecture, config_cls, model_cls, prefix = FAMILY_CLASSES[family]
    config = _import(config_cls)(**vision, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    torch.manual_seed(0)
    with torch.device(device):
        model = _import(model_cls)._from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    full_config = {
        "model_type": model_type,
        "architectures": [architecture],
        "vision_config": config.to_dict(),
        "text_config": {"hidden_size": vision["out_hidden_size"]},
    }
    (directory / "config.json").write_text(json.dumps(full_config, indent=2))
    preprocessor = {"patch_size": vision["patch_size"], "merge_size": 2, "temporal_patch_size": 2}
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return model


def reference_rows(output) -> torch.Tensor:
    """[num_tokens, row_width] from the vision model's output, whatever the transformers version returns."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):  # older Qwen3: (merged, deepstack list)
        return torch.cat([output[0], *output[1]], dim=1)
    deepstack = getattr(output, "deepstack_features", None) or []
    return torch.cat([output.pooler_output, *deepstack], dim=1)


def build_checkpoint(family: str, small: bool, device: torch.device, dtype: torch.dtype, directory: Path, *,
                     keep: bool = False):
    """Random-weight vision tower of the real (or --small) size, saved as a checkpoint the service loads, with
    the released checkpoint's preprocessing. `keep`: return transformers' model (the reference), else None."""
    vision = (SMALL if small else REAL)[family]
    model = build_reference(family, vision, device, dtype, directory)
    if not keep:
        model = None  # the service loads its own copy; free this one before measuring memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    pre = dict(PREPROCESS[family], patch_size=vision["patch_size"], temporal_patch_size=2, merge_size=2,
               image_processor_type="Qwen2VLImageProcessor", do_resize=True, do_rescale=True,
               rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)
    if small:
        pre.update(min_pixels=4 * (2 * vision["patch_size"]) ** 2, max_pixels=256 * (2 * vision["patch_size"]) ** 2)
    (directory / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return model
