#!/usr/bin/env bash
# On the GPU machine: install jaxsync without dependencies and run `jaxsync bench`.
# Usage: bash tools/bench.sh OUT_DIR [jaxsync bench options...]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"; shift || true
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || {
  cat "$out/install.log"; exit 1; }
export PYTHONUNBUFFERED=1
jaxsync bench --out "$out" "$@" 2>&1 | tee "$out/bench.log"
exit "${PIPESTATUS[0]}"
