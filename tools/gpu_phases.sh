#!/usr/bin/env bash
# A GPU run of jaxsync in phases of a few minutes each.
# Usage: bash tools/gpu_phases.sh OUT_DIR PHASE [FAMILY ...]
#   check    - gpu-marked tests, then `jaxsync verify` under the default and the TFRT client
#   bench    - `jaxsync bench --sizes released` per family (default: all), default client
#   tfrt     - the same bench under the TFRT GPU client (host time per call)
#   host     - jaxsync's rows only (no baselines), default client: its host time per call
#   profile  - `jaxsync bench profile`: device time per op class (default: voxtral glm4v)
#   sharded  - (2+ GPUs) the sharded kv tests
# Set SKIP_INSTALL=1 when the caller installed jaxsync already.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_phases.sh OUT_DIR PHASE [FAMILY ...]}"
phase="${2:?usage: gpu_phases.sh OUT_DIR PHASE [FAMILY ...]}"
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . \
  >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import jax, torch, transformers as t; print('jax', jax.__version__, 'torch', \
torch.__version__, 'transformers', t.__version__, jax.devices())" | tee "$out/versions.txt"
families=("$@")
bench() {  # $1: label, then bench options; one process per family keeps each inside its limit
  local label=$1 fam
  shift
  [ ${#families[@]} -gt 0 ] || families=(kv chameleon gemma3n glm4v voxtral qwen3_omni)
  for fam in "${families[@]}"; do
    timeout "${BENCH_TIMEOUT:-180}" python3 -m jaxsync bench --paths "$fam" --sizes released \
      --out "$out/$label-$fam" "$@" 2>&1 \
      | tail -40 | tee "$out/$label-$fam.log"
  done
}
case "$phase" in
  check)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu-tests.log"
    timeout 150 python3 -m jaxsync verify 2>&1 | tee "$out/verify-default.txt"
    XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 timeout 150 python3 -m jaxsync verify 2>&1 \
      | tee "$out/verify-tfrt.txt"
    ;;
  bench) bench bench ;;
  tfrt) XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 bench tfrt ;;
  host)
    [ ${#families[@]} -gt 0 ] || families=(chameleon gemma3n glm4v voxtral qwen3_omni)
    bench host --jaxsync-only
    ;;
  profile)
    [ ${#families[@]} -gt 0 ] || families=(voxtral glm4v)
    timeout 400 python3 -m jaxsync bench profile --paths "${families[@]}" 2>&1 \
      | tee "$out/profile.txt"
    ;;
  sharded)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kv tests/test_device_cache.py \
      2>&1 | tail -15 | tee "$out/sharded-tests.log"
    ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
