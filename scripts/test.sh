#!/usr/bin/env bash
# Sets up .venv (runtime + test tools) and runs the whole CPU test suite, then the engine tiers (each in a
# venv of its own: scripts/tiers/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/python -m pytest -q -ra "$@"
bash scripts/tiers/sglang.sh
