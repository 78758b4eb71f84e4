"""The towers the benchmarks build: transformers' own vision models of Qwen2.5-VL-7B and Qwen3-VL-8B at their
real sizes (or tiny, --small) with random weights, saved as checkpoints our loader reads (the configs and the
builder: tests/support/vision_checkpoints.py, which the tests share)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.vision_checkpoints import REAL, build_reference, released_preprocessing

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


def patch_grid(width: int, height: int, patch: int) -> tuple[int, int, int]:
    """(t, h, w) of one image resized to the nearest multiples of patch * 2 (smart_resize within bounds)."""
    factor = patch * 2
    resized_height, resized_width = (max(factor, round(x / factor) * factor) for x in (height, width))
    return (1, resized_height // patch, resized_width // patch)


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
    pre = released_preprocessing(family, vision["patch_size"])
    if small:  # images of at most 256 tokens
        pre.update(min_pixels=4 * (2 * vision["patch_size"]) ** 2, max_pixels=256 * (2 * vision["patch_size"]) ** 2)
    (directory / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return model
