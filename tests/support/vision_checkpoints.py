"""Vision-only checkpoints of transformers' own towers (Qwen2.5-VL, Qwen3-VL) with random weights, saved as our
loader reads them: the released checkpoints' vision configs and preprocessing, and a Qwen3-VL tower that is tiny
but whose rows are as wide as Qwen3-VL-8B's (tests/service/test_socket_send.py, benchmarks/transfer_bench.py: rows
of many MB from small images; the tower is not what they measure). The benchmarks build theirs from these too
(benchmarks/common/models.py)."""

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

# Preprocessing of the released checkpoints (their preprocessor_config.json).
PREPROCESS = {
    "qwen2_5_vl": dict(min_pixels=3136, max_pixels=12845056, image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711]),
    "qwen3_vl": dict(min_pixels=65536, max_pixels=16777216, image_mean=[0.5] * 3, image_std=[0.5] * 3),
}


def _import(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


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


def released_preprocessing(family: str, patch_size: int) -> dict:
    """The preprocessor_config.json of the released checkpoint of `family`, for a tower of `patch_size`."""
    return dict(PREPROCESS[family], patch_size=patch_size, temporal_patch_size=2, merge_size=2,
                image_processor_type="Qwen2VLImageProcessor", do_resize=True, do_rescale=True,
                rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)


def build_wide_rows(directory: Path, out_hidden: int) -> None:
    """A Qwen3-VL checkpoint with a tiny tower, rows `out_hidden` x 4 wide (Qwen3-VL-8B: 4096), bf16, and the
    released preprocessing (a 720p image is 880 rows, as with the 8B)."""
    vision = REAL["qwen3_vl"] | dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4,
                                     out_hidden_size=out_hidden, deepstack_visual_indexes=[0, 1, 2],
                                     num_position_embeddings=16)
    build_reference("qwen3_vl", vision, torch.device("cpu"), torch.bfloat16, directory)
    pre = released_preprocessing("qwen3_vl", vision["patch_size"])
    (directory / "preprocessor_config.json").write_text(json.dumps(pre))
