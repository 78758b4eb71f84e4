#!/usr/bin/env bash
# Sets up .venv (runtime + test tools), lints the code (ruff, configured in pyproject.toml) and runs the whole CPU
# test suite, then each test tier that runs another engine's own code in a venv of its own: a tier is its name,
# NAME runs `scripts/tiers/NAME.sh`. TEST_TIERS names them (default below; TEST_TIERS="" runs none). Arguments go
# to the main suite's pytest.
#
# Every step runs even when one before it failed (a red main suite must not hide the tiers' state); the
# output ends with one line per step (name, passed/failed, seconds) and the exit status is 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ionice -c 3 true 2>/dev/null && IONICE="ionice -c 3"  # where the idle I/O class is allowed
DEFAULT_TIERS="torchvision sglang vllm vllm-e2e image"

summary=()
failed=0
step() {  # NAME COMMAND...: runs COMMAND, records NAME's summary line
  local name="$1" start=$SECONDS rc=0 outcome=passed
  shift
  "$@" || rc=$?
  if [ "$rc" != 0 ]; then
    outcome="failed (exit $rc)"
    failed=1
  fi
  summary+=("$(printf '%-14s %-18s %6d s' "$name" "$outcome" $((SECONDS - start)))")
}

TIERS="${TEST_TIERS-$DEFAULT_TIERS}"
step setup scripts/setup.sh test

# The tiers' venvs are made while the main suite runs (TIER_PREPARE: downloads and unpacking), one after another,
# at the lowest CPU and I/O priority: the suite keeps most of the machine (it runs somewhat slower), and the
# whole takes minutes less. A venv that failed there is made again by its tier's own run, which shows why.
prepare_log="$(mktemp)"
(
  for tier in $TIERS; do
    if grep -q "^tier_venv " "scripts/tiers/$tier.sh" 2>/dev/null; then
      TIER_PREPARE=1 nice -n 19 ${IONICE:-} bash "scripts/tiers/$tier.sh" || echo "$tier: venv not made here (exit $?)"
    fi
  done
) >"$prepare_log" 2>&1 &
preparing=$!
# Interrupted: the preparation stops too (a second run must not build the same venvs beside it).
trap 'kill "$preparing" 2>/dev/null; pkill -P "$preparing" 2>/dev/null; rm -f "$prepare_log"; exit 130' INT TERM

step lint .venv/bin/python -m ruff check .
step main .venv/bin/python -m pytest -q -ra "$@"
wait "$preparing"
trap - INT TERM
cat "$prepare_log"
rm -f "$prepare_log"
for tier in $TIERS; do
  step "$tier" env -u TIER_PREPARE bash "scripts/tiers/$tier.sh"
done

echo
echo "scripts/test.sh summary:"
printf '  %s\n' "${summary[@]}"
exit "$failed"
