#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu_wheels.txt (CPython 3.12, x86-64 Linux; no dependencies: the list names each
# one) into the git-ignored .whl/ for benchmarks/gpu.sh on a GPU machine that can fetch nothing, then check them
# against the list and the machine's packages (benchmarks/_packages.py check-wheels) and print their total size.
#
#   bash benchmarks/gpu_wheels.sh          # needs pip and a package index; .whl/ then travels with the checkout
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
mkdir -p .whl
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' benchmarks/gpu_wheels.txt)
# one version of each: wheels of an earlier list go
for wheel in .whl/*.whl; do
  [ -e "$wheel" ] || continue
  keep=0
  for spec in "${wanted[@]}"; do
    name="${spec%%==*}"; version="${spec#*==}"
    prefix="$(echo "$name" | tr 'A-Z.-' 'a-z__')-${version}-"
    case "$(basename "$wheel" | tr 'A-Z' 'a-z')" in "$prefix"*) keep=1 ;; esac
  done
  [ "$keep" = 1 ] || { echo "removing $wheel (not in benchmarks/gpu_wheels.txt)"; rm -f "$wheel"; }
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${wanted[@]}"
"$PYTHON" benchmarks/_packages.py check-wheels .whl
echo "the checkout that travels (tracked files): $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
