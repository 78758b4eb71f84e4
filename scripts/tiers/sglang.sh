#!/usr/bin/env bash
# SGLang tier: SGLang 0.5.23's own language-side receiver code against our service (--sglang-protocol), on
# CPU: tests/engines/sglang/ (docs/sglang.md has the deployment those tests run).
#
# Two venvs: the main `.venv` ($ENCODER_MAIN_PYTHON) runs our service (as deployed: `encoder-service serve ...`,
# a subprocess; the sglang extra gives it pyzmq), and `.venv-sglang` (scripts/tiers/venv.sh: CPU torch 2.13.0
# first, reused while this script and the lock below are unchanged) runs SGLang and the tests. SGLang goes in with
# --no-deps together with a lock of exactly what its receiver needs on CPU
# (tests/engines/sglang/requirements.txt); no .pyc compilation at install (Python compiles what it imports).
# PyPI's torchvision is a CUDA build: the import shim (tier_shim_torchvision) lets it load with CPU torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source scripts/tiers/venv.sh
LOCK=tests/engines/sglang/requirements.txt
t0=$SECONDS

# Our service's side: the main venv with pyzmq (scripts/test.sh made it; a bare checkout gets it here).
export ENCODER_MAIN_PYTHON="${ENCODER_MAIN_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$ENCODER_MAIN_PYTHON" ] || scripts/setup.sh
# (Not while scripts/test.sh prepares the venv: its main suite is running from that venv.)
[ "${TIER_PREPARE:-0}" = 1 ] || "$ENCODER_MAIN_PYTHON" -c "import zmq" 2>/dev/null \
  || "$ENCODER_MAIN_PYTHON" -m pip install -q -e ".[sglang]"

t1=$SECONDS
tier_venv sglang scripts/tiers/sglang.sh "$LOCK"
if [ "$TIER_FRESH" = 1 ]; then
  echo "sglang tier: venv + CPU torch in $((SECONDS - t1))s"
  t1=$SECONDS
  # torch pinned: nothing in the lock may swap the CPU build (it is not in the lock; this guards it anyway).
  echo "torch==2.13.0" > "$VENV/torch-constraint.txt"
  PIP_CONSTRAINT="$VENV/torch-constraint.txt" tier_pip install -q --no-deps -r "$LOCK"
  "$PY" -c "import torch; assert torch.__version__.startswith('2.13.0') and not torch.cuda.is_available()"
  tier_shim_torchvision
  tier_done
  echo "sglang tier: SGLang + its lock ($(grep -c '==' "$LOCK") packages) in $((SECONDS - t1))s"
fi
echo "sglang tier: venvs ready in $((SECONDS - t0))s"

# --confcutdir: the repo's root conftest (tiny checkpoints, Redis) is the main venv's; this tier needs none.
exec "$PY" -m pytest -q -ra -p no:cacheprovider --confcutdir=tests/engines tests/engines/sglang "$@"
