#!/usr/bin/env bash
# Installs everything (scripts/setup.sh; skip with LIGHTNING_GRPO_SKIP_SETUP=1) and runs the test suite.
# Arguments go to pytest, e.g. tests/test_functional.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${LIGHTNING_GRPO_SKIP_SETUP:-0}" = "1" ] || bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# lint and import order first (a second): pyproject.toml's [tool.ruff]. The pure layer's types ([tool.mypy], ~30 s of
# one core on a fresh clone) are checked beside the suite, whose workers wait on servers, sandboxes and sleeping
# processes part of the time; the run fails if either does.
mypy_pid=""
if [ "$#" -eq 0 ]; then
  .venv/bin/ruff check .
  .venv/bin/mypy &
  mypy_pid=$!
fi
# One torch thread per process: the two pytest workers below and every process a test starts (torch's threads collapse
# on 2 cores when anything else runs; tests/README.md).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
# The whole suite in one pytest run on two workers (pytest-xdist), a test file per worker at a time (its module
# fixtures built once); the 25 slowest tests are listed at the end (tests/README.md keeps that table).
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${LIGHTNING_GRPO_TEST_WORKERS:-2}" --dist loadfile \
  --durations=25 || status=$?
wait "$mypy_pid" || { echo "mypy failed (its errors are above)" >&2; [ "$status" -ne 0 ] || status=1; }
exit "$status"
