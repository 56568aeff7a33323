#!/usr/bin/env bash
# One-off GPU exploration (session 2): host dispatch cost of qwen3_omni under XLA:GPU client and
# command-buffer settings, then the kv and gemma3n benches and the gemma3n GPU parity test.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_explore.sh OUT_DIR}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || {
  cat "$out/install.log"; exit 1; }
echo "== dispatch tfrt client"
XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 timeout 70 python3 tools/explore_dispatch.py 2>&1 \
  | grep -v -i warn | tail -9
for m in SKIP_TEMP SKIP_PROFILED; do
  echo "== dispatch update_mode=$m"
  XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$m" timeout 60 python3 tools/explore_dispatch.py \
    2>&1 | grep -v -i warn | tail -9
done
echo "== kv bench"
timeout 130 jaxsync bench --paths kv --sizes released --out "$out/kv" 2>&1 | grep -v "^E1\|^===\|^external\|^$" | tail -12
echo "== gemma3n bench"
timeout 190 jaxsync bench --paths gemma3n --sizes released --out "$out/gemma3n" 2>&1 | grep -v "^E1\|^===\|^external\|^$" | tail -8
echo "== gemma3n gpu test"
timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/models/test_gemma3n_gpu.py 2>&1 | tail -4
