"""The dtypes rows travel in, by the names every answer uses (encode answers, wire headers, metadata,
client buffers): the one table of names and torch dtypes."""

from __future__ import annotations

import torch

from encoder_service.errors import InvalidInput

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class UnsupportedDtype(InvalidInput):
    """A dtype (or dtype name) rows are never sent in."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """The name of `dtype` (torch.bfloat16 -> "bfloat16"; a supported name as is); UnsupportedDtype else."""
    name = dtype if isinstance(dtype, str) else _NAMES.get(dtype)
    if name not in DTYPES:
        raise UnsupportedDtype(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    return name


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype of `dtype` ("bfloat16" -> torch.bfloat16; a supported dtype as is); UnsupportedDtype else."""
    return DTYPES[dtype_name(dtype)]
