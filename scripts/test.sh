#!/usr/bin/env bash
# Sets up .venv (runtime + test tools) and runs the whole CPU test suite, then each test tier in its own
# venv (scripts/tiers/<tier>.sh; TEST_TIERS="" runs none). Arguments go to the main suite's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/python -m pytest -q -ra "$@"
for tier in ${TEST_TIERS-torchvision}; do
  "scripts/tiers/$tier.sh"
done
