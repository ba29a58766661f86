# Sourced by benchmarks/gpu.sh and benchmarks/gpu_vision.sh from the repository root, with PYTHON set: installs the
# carried wheels (.whl/, from `bash benchmarks/gpu_wheels.sh`) into their own folder beside the machine's packages,
# never over them, and puts that folder first on PYTHONPATH. Nothing is fetched (--no-index). No .whl/: nothing done.
# The wheels are CPython 3.12's (pip refuses them under another Python: remove .whl/ where the packages are installed).
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE="${GPU_BENCH_SITE:-${TMPDIR:-/tmp}/lightning_grpo_gpu_site}"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "installed $(compgen -G '.whl/*.whl' | wc -l) carried wheels into $SITE"
fi
