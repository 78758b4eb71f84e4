#!/usr/bin/env bash
# Shared by the tier scripts beside it: `source scripts/tiers/venv.sh; tier_venv NAME INPUTS...` makes (or
# reuses) `.venv-NAME` for a test tier that runs another engine's own code (vLLM, SGLang, transformers'
# torchvision processor), which can't share the main `.venv`.
#
# Order, so that nothing pulls a multi-GB CUDA build of torch: CPU torch first (`torch==2.13.0`, the local
# CPU wheel), then what the tier's own script installs with --no-deps. The venv is reused while a stamp of
# its inputs (this file and the files named in INPUTS: the tier's script and its lock) is unchanged: CI from
# a clean checkout builds it once; a developer's second run skips the install. Installs compile no .pyc
# (Python compiles what it imports) and `tier_pip` drops pip's notices about index locations this machine
# lacks, so the output is the tier's own lines and real errors.
#
# TIER_PREPARE=1 makes the venv and stops there (scripts/test.sh builds them while the main suite runs).
#
# `tier_shim_torchvision VENV`: PyPI only has CUDA builds of torchvision, whose compiled ops can't load next
# to CPU torch; tests/engines/torchvision_cpu_shim.py (installed through a .pth file, so subprocesses get it
# too) defines the two op schemas its import needs. Only the pure-Python transforms are used.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PIP_NO_COMPILE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# In a tier the engine must import: its tests fail instead of skipping (tests/support/engine_tier.py).
export ENCODER_ENGINE_TIER=1

tier_pip() {  # ARGS: `$PY -m pip ARGS`, without the "Location ... is ignored" notices
  "$PY" -m pip "$@" 2>&1 | { grep -v -E "is ignored: it is neither a file nor a directory" || true; }
}

tier_venv() {  # NAME INPUTS... -> sets VENV, PY, and TIER_FRESH=1 when the caller must install
  local name="$1"; shift
  VENV="$ROOT/.venv-$name"
  PY="$VENV/bin/python"
  local stamp
  stamp="$(cat "$ROOT/scripts/tiers/venv.sh" "$@" | sha256sum | cut -c1-16)"
  if [ -x "$PY" ] && [ "$(cat "$VENV/.tier-stamp" 2>/dev/null)" = "$stamp" ]; then
    TIER_FRESH=0
    [ "${TIER_PREPARE:-0}" != 1 ] || exit 0
    return 0
  fi
  rm -rf "$VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
  tier_pip install -q torch==2.13.0
  echo "$stamp" > "$VENV/.tier-stamp.pending"
  TIER_FRESH=1
}

tier_done() {  # marks the venv complete (only after every install of the tier succeeded)
  mv "$VENV/.tier-stamp.pending" "$VENV/.tier-stamp"
  if [ "${TIER_PREPARE:-0}" = 1 ]; then
    echo "$(basename "$VENV") made in $SECONDS s (while the main suite ran)"
    exit 0
  fi
}

tier_install_cached() {  # NAME LOCK PINS...: PINS and LOCK with --no-deps, from a wheel cache kept across rebuilds
  local name="$1" lock="$2"; shift 2
  local wheels="${TIER_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/encoder-service/wheels}"
  local done="$wheels/.$name-$(echo "$@" | cat - "$lock" | sha256sum | cut -c1-16)"  # these wheels are there
  if [ ! -e "$done" ]; then
    mkdir -p "$wheels"
    tier_pip download -q --no-deps --only-binary=:all: -d "$wheels" "$@" -r "$lock"
    touch "$done"
  fi
  tier_pip install -q --no-deps --no-index --find-links "$wheels" "$@" -r "$lock"
}

tier_shim_torchvision() {
  local sp
  sp="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp "$ROOT/tests/engines/torchvision_cpu_shim.py" "$sp/"
  echo "import torchvision_cpu_shim; torchvision_cpu_shim.install()" > "$sp/zz_torchvision_cpu_shim.pth"
}
