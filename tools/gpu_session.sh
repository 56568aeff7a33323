#!/usr/bin/env bash
# Everything a GPU session needs, in phases that each fit one 10-minute device call.
# Usage: bash tools/gpu_session.sh OUT_DIR PHASE
#   check   - install, gpu-marked tests, the full test suite on the GPU, jaxsync verify (streams)
#   bench   - jaxsync bench at released sizes: table, bench.json, bench.png under OUT_DIR/bench
#   sharded - (2+ GPUs) sharded KV / DeviceCache tests over every GPU + tools/bench_kv_sharded.py
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_session.sh OUT_DIR PHASE}"
phase="${2:?usage: gpu_session.sh OUT_DIR PHASE}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || {
  cat "$out/install.log"; exit 1; }
python3 -c "import jax, torch, transformers as t; print(jax.__version__, torch.__version__, \
t.__version__, jax.devices())" | tee "$out/versions.txt"
case "$phase" in
  check)
    timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu-tests.log"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -x tests 2>&1 | tail -30 | tee "$out/suite.log"
    timeout 200 jaxsync verify 2>&1 | tee "$out/verify.txt"
    ;;
  bench)
    timeout 560 jaxsync bench --sizes released --out "$out/bench" 2>&1 | tail -60
    ;;
  sharded)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kv tests/test_device_cache.py 2>&1 \
      | tail -20 | tee "$out/sharded-tests.log"
    timeout 240 python3 tools/bench_kv_sharded.py --out "$out/kv-sharded.json" 2>&1 | tail -12
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
