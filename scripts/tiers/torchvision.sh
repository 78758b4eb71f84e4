#!/usr/bin/env bash
# The torchvision tier: our `--preprocess torchvision` backend on the CPU against transformers' default Qwen-VL
# image processor, `Qwen2VLImageProcessor` (torchvision), bit for bit (tests/engines/test_torchvision_processor.py),
# and our video preprocessing against its video processors, `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor`
# (tests/engines/test_torchvision_video.py; PyAV decodes the clips); in the main venv they are skipped. Its venv
# (venv.sh): CPU torch 2.13.0, torchvision 0.28.0 (the release for torch 2.13, the Dockerfile's pair) through the
# import shim, and transformers at the LOWER end of pyproject's range (the main venv gets the upper end), so the
# main suite's parity tests against transformers' own towers and PIL processor run here too, at that end.
#   scripts/tiers/torchvision.sh [pytest args]
set -euo pipefail
source "$(dirname "$0")/venv.sh"
tier_venv torchvision "$ROOT/scripts/tiers/torchvision.sh"
if [ "$TIER_FRESH" = 1 ]; then
  tier_pip install -q --no-deps torchvision==0.28.0
  tier_pip install -q transformers==5.23.0 numpy==2.4.6 pillow==13.0.0 av==18.1.0 \
    pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
  tier_shim_torchvision
  tier_done
fi
cd "$ROOT"
# The package itself is found through pytest's pythonpath (pyproject), not installed; the root conftest's tiny
# checkpoints need only transformers and its dependencies.
exec "$PY" -m pytest -q -ra tests/engines/test_torchvision_processor.py tests/engines/test_torchvision_video.py \
  tests/unit/test_models_parity.py tests/unit/test_preprocessing.py "$@"
