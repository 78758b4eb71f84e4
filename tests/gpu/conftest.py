"""GPU tier: every test here needs CUDA and is skipped without it (CI has no GPU; run it on the GPU machine
with `python -m pytest tests/gpu`)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
