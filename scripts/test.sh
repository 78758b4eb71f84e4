#!/usr/bin/env bash
# Sets up .venv (runtime + test tools) and runs the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest -q -ra "$@"
