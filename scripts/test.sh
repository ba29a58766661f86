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
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
