#!/usr/bin/env bash
# Sets up .venv and runs the service. With no --model it builds a tiny random-weight
# Qwen2.5-VL checkpoint under .demo/ and serves it (offline, CPU-friendly).
#   scripts/serve.sh                                   offline demo on 127.0.0.1
#   scripts/serve.sh --model Qwen/Qwen2.5-VL-7B-Instruct --host 0.0.0.0
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [[ " $* " != *" --model "* && -z "${ENCODER_MODEL:-}" ]]; then
  set -- --model demo:qwen2_5_vl "$@"
fi
exec .venv/bin/encoder-service serve "$@"
