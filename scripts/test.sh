#!/usr/bin/env bash
# Installs everything (scripts/setup.sh; skip with LIGHTNING_GRPO_SKIP_SETUP=1) and runs the test suite.
# Arguments go to pytest, e.g. tests/test_functional.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${LIGHTNING_GRPO_SKIP_SETUP:-0}" = "1" ] || bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# lint, import order and the pure layer's types first (seconds): pyproject.toml's [tool.ruff] and [tool.mypy]
if [ "$#" -eq 0 ]; then
  .venv/bin/ruff check .
  .venv/bin/mypy
fi
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
# The whole suite in three pytest processes: one process's resident memory only grows with every in-process vLLM
# engine and model the tests build (18 GiB by 83 % of the suite in one process on a 24 GiB machine); each part starts
# afresh. Together they collect every test once: the engine folders, every other folder of tests/, the top-level files.
ENGINES="tests/rollout tests/episodes tests/strategies tests/rewards"
REST=$(for d in tests/*/; do d=${d%/}; case " $ENGINES " in *" $d "*) ;; *) [ "$(basename "$d")" = __pycache__ ] || echo "$d";; esac; done)
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider $ENGINES || status=$?
.venv/bin/python -m pytest -q -p no:cacheprovider $REST || status=$?
.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_*.py || status=$?
exit $status
