#!/usr/bin/env bash
# One short GPU benchmark (< 10 minutes in all, offline; benchmarks/gpu.py): our GRPO step on a random
# Qwen2.5-0.5B-shaped policy built on the spot (bf16 and float32 on one device, FSDP2 and FSDP1 in bf16, colocated
# vLLM on CUDA; routing replay R3 through vLLM on a random Qwen3-MoE) against TRL's on the same GPU; tokens/s, peak
# CUDA memory and the step's phases as JSON and a table.
#
#   bash benchmarks/gpu.sh              # writes $OUT/gpu.json when $OUT is set, else benchmarks/results/gpu.json
#   bash benchmarks/gpu.sh --dry-run    # the same code on a CPU, about 40 s of CPU time (the tests run it)
#   ROWS=hf,trl bash benchmarks/gpu.sh  # a subset of hf,trl,hf_fp32,fsdp2,fsdp1,vllm,hf_offload
#
# Needs python3 with torch (CUDA), transformers, lightning, peft and torchmetrics. The packages the GPU machine lacks
# (benchmarks/gpu_wheels.txt) are installed from .whl/ when it is there (`bash benchmarks/gpu_wheels.sh` downloads
# them where pip can reach an index; bring .whl/ along); nothing is downloaded here. A row whose package is missing
# (vllm: a vLLM CUDA build; trl) is skipped with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
DRY_RUN=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY_RUN=1; done
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT_FILE="${OUT:+$OUT/gpu.json}"
OUT_FILE="${OUT_FILE:-benchmarks/results/gpu.json}"

# the carried wheels (not in a dry run: its machine has the packages, which gpu.py hides down to the GPU machine's)
[ "$DRY_RUN" = 1 ] || . benchmarks/_carried_wheels.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" benchmarks/_packages.py preflight

if [ "$DRY_RUN" = 0 ]; then
  "$PYTHON" -c "import sys, torch; torch.cuda.is_available() or sys.exit('benchmarks/gpu.sh: torch ' + \
torch.__version__ + ' sees no CUDA device (--dry-run runs on a CPU)'); print('GPU:', torch.cuda.get_device_name(0), \
'| torch', torch.__version__)"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
fi

# bounded: gpu.py --budget covers the model's build and every row (no row starts after it, none runs past it), and
# is what is left of 9 minutes after the set-up above; the report is written after it: under 10 minutes in all
budget=$(( 540 - (SECONDS - started) ))
timeout $(( 590 - (SECONDS - started) )) "$PYTHON" benchmarks/gpu.py ${ROWS:+--rows "$ROWS"} --budget "$budget" \
  --out "$OUT_FILE" "$@"
