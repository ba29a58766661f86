#!/usr/bin/env bash
# One short GPU benchmark (< 10 minutes, offline): our GRPO step (one device bf16, colocated vLLM on CUDA, FSDP2 and
# FSDP1 in bf16) against TRL's on the same GPU; tokens/s per GPU and peak memory as JSON (benchmarks/gpu.py).
#
#   bash benchmarks/gpu.sh                 # writes benchmarks/results/gpu.json (or $OUT/gpu.json when $OUT is set)
#   ROWS=trl,hf bash benchmarks/gpu.sh     # a subset of trl,hf,vllm,fsdp2,fsdp1,hf_offload
#
# Needs, already installed (nothing is downloaded): torch with CUDA, vLLM built for CUDA, trl==1.16.0, this
# package's dependencies, and the embedded SmolLM2-135M-Instruct in the package cache (`lightning-grpo-model`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
OUT_FILE="${OUT:+$OUT/gpu.json}"
OUT_FILE="${OUT_FILE:-benchmarks/results/gpu.json}"

"$PYTHON" - <<'PY'
import importlib.util, sys
import torch
missing = [name for name in ("vllm", "trl", "lightning", "transformers") if importlib.util.find_spec(name) is None]
if not torch.cuda.is_available():
    sys.exit("benchmarks/gpu.sh: torch sees no CUDA device (torch %s)" % torch.__version__)
if missing:
    sys.exit("benchmarks/gpu.sh: missing packages: " + ", ".join(missing))
from lightning_grpo.models.embedded import default_model_path
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| model", default_model_path())
PY
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true

# 4 rows x <= 90 s + the vLLM row <= 200 s: under 10 minutes in all (a row that runs over is reported as failed)
timeout 580 "$PYTHON" benchmarks/gpu.py --rows "${ROWS:-trl,hf,vllm,fsdp2,fsdp1}" --timeout 90 --out "$OUT_FILE" "$@"
