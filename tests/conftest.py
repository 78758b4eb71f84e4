"""Shared fixtures: tiny random-weight checkpoints, built once per test session in a temp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoder_service.testing.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(family) -> Path`: a tiny checkpoint of that family (built on first use, then reused;
    treat it as read-only, copy it to modify it)."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny_checkpoints")

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_checkpoint(family, root / family)
        return built[family]

    return get

