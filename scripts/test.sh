#!/usr/bin/env bash
# Sets up .venv (runtime + test tools) and runs the whole CPU test suite, then each test tier that runs another
# engine's own code in a venv of its own (scripts/tiers/<tier>.sh; TEST_TIERS="" runs none). Arguments go to
# the main suite's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/python -m pytest -q -ra "$@"
for tier in ${TEST_TIERS-torchvision sglang vllm vllm-e2e}; do
  bash "scripts/tiers/$tier.sh"
done
