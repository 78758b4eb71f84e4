"""How a checkpoint's vision tensors become a tower's parameters.

A parameter is stored as itself (a checkpoint key minus its `visual.` prefix is its name) unless a module's
`checkpoint_layout()` places it: `PatchEmbed` (the Conv3d weight, held as a Linear) and the MLPs (width
zero-padded, Qwen2.5's gate and up merged into one weight; models/layers.py). The loader checks a
checkpoint's names and shapes against `checkpoint_layout(tower)` (the shapes as stored) and copies each
tensor into its place in zero-filled parameters (models/loader.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


def _whole(param: torch.Tensor) -> torch.Tensor:
    return param


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor: its shape as stored, the parameter it goes into, and the view of that parameter
    it is copied into; a parameter's elements outside every such view stay zero (the MLP padding)."""

    shape: tuple[int, ...]
    param: str
    view: Callable[[torch.Tensor], torch.Tensor] = _whole


def checkpoint_layout(tower: nn.Module) -> dict[str, Stored]:
    """Checkpoint tensor name (no `visual.` prefix) -> where it goes in the tower."""
    layout: dict[str, Stored] = {}
    for prefix, module in tower.named_modules():
        if hasattr(module, "checkpoint_layout"):
            for name, stored in module.checkpoint_layout().items():
                layout[f"{prefix}.{name}"] = dataclasses.replace(stored, param=f"{prefix}.{stored.param}")
    placed = {stored.param for stored in layout.values()}
    for name, param in tower.named_parameters():
        if name not in placed:
            layout[name] = Stored(tuple(param.shape), name)
    return layout
