#!/usr/bin/env bash
# On a GPU machine with jax/flax/chex/torch/transformers preinstalled and no network:
# install jaxsync without dependencies, run the gpu-marked tests, then `jaxsync verify`.
# Usage: bash tools/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-out}}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || {
  cat "$out/install.log"; exit 1; }
python3 -c "import jax; print('devices:', jax.devices())" | tee "$out/devices.txt"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
jaxsync verify --json >"$out/verify.json"
verify_rc=$?
jaxsync verify 2>&1 | tee "$out/verify.txt"
echo "gpu tests rc=$tests_rc verify rc=$verify_rc"
[ "$tests_rc" -eq 0 ] && [ "$verify_rc" -eq 0 ]
