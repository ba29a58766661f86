#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the GSM8K GRPO recipe on the embedded SmolLM2-135M-Instruct.
# Extra arguments are passed to `lightning-grpo fit`, e.g. --trainer.max_steps 20.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/lightning-grpo fit --config recipes/gsm8k_grpo.yaml "$@"
