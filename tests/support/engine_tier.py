"""The engine tiers' import of their engine (stdlib + pytest: the tiers' venvs import it).

`require(module, tier_script)`: in the main venv the engine is not installed and the test module is skipped;
inside its tier (scripts/tiers/venv.sh exports ENCODER_ENGINE_TIER) a failed import is an error, so a broken
tier venv fails CI instead of passing as all-skipped.
"""

from __future__ import annotations

import importlib
import os

import pytest

TIER_ENV = "ENCODER_ENGINE_TIER"


def require(module: str, tier_script: str):
    if os.environ.get(TIER_ENV):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"runs in its tier's own venv: bash {tier_script}")
