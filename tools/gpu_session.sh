#!/usr/bin/env bash
# Everything a GPU session needs, in phases that each fit one 10-minute device call.
# Usage: bash tools/gpu_session.sh OUT_DIR PHASE
#   check   - install, gpu-marked tests, the kv suite on the GPU, jaxsync verify (streams)
#   bench1  - jaxsync bench, released sizes: kv, qwen3_omni, voxtral, chameleon (OUT_DIR/bench-bench1.tgz)
#   bench2  - the same for gemma3n and glm4v (OUT_DIR/bench-bench2.tgz)
#   dispatch - Pallas copy parity; pinned-host swap layouts; qwen3_omni host time, stacked layers
#   followup - kv proofs on the GPU, `jaxsync verify --paths kv`, pool swaps with a prototype
#              h2d in runs of consecutive pool ids, the Mosaic GPU copy against Triton and XLA
#   suite1 / suite2 - the CPU test suite (models / core) on the GPU
#   h2dhost - h2d through Triton kernels that read the pinned pool directly (the prototype of
#             swap_in's GPU kernel; BLOCKS="512 64" by default)
#   kvhost  - copy_blocks host time, split, with the id upload's parts (both runtime clients)
#   h2dflags - pool swaps under XLA flags that may put more host reads in flight
#   host    - qwen3_omni host time under the TFRT client: the bench (median of 11), unpacked vs
#             packed weights, a call split into steps, dispatch variants (OUT_DIR/bench-host.tgz)
#   hostflags - qwen3_omni host time under TFRT with XLA command-buffer flags (the eighth
#             session's open lead), then with the CPUs held out of deep idle states
#   tfrt    - under the TFRT GPU client: `jaxsync verify` over every path, the gpu-marked tests
#   sharded - (2+ GPUs) sharded KV / DeviceCache tests over every GPU + tools/bench_kv_sharded.py
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_session.sh OUT_DIR PHASE}"
phase="${2:?usage: gpu_session.sh OUT_DIR PHASE}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# SKIP_INSTALL=1: the caller installed already (phases run side by side on a multi-GPU box).
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . \
  >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import jax, torch, transformers as t; print(jax.__version__, torch.__version__, \
t.__version__, jax.devices())" | tee "$out/versions.txt"
case "$phase" in
  check)
    timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu-tests.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kv 2>&1 | tail -15 | tee "$out/suite.log"
    timeout 180 jaxsync verify 2>&1 | tee "$out/verify.txt"
    ;;
  bench1 | bench2)
    # One process per family: all six in one process outrun a 10-minute device call (H200:
    # kv ~170 s, gemma3n ~190 s, voxtral ~130 s, qwen3_omni (two encoders) ~120 s, glm4v and
    # chameleon ~80-100 s each).
    # FAMS="name:seconds ..." overrides the phase's families.
    if [ "$phase" = bench1 ]; then fams="kv:220 qwen3_omni:160 voxtral:140 chameleon:100"
    else fams="gemma3n:200 glm4v:150"; fi
    fams="${FAMS:-$fams}"
    for f in $fams; do
      name=${f%%:*}
      timeout "${f##*:}" jaxsync bench --paths "$name" --sizes released --out "$out/bench/$name" \
        2>&1 | grep "measured"
    done
    # The device tool returns a limited number of files: one archive.
    tar czf "$out/bench-$phase.tgz" -C "$out" bench && rm -rf "$out/bench"
    ;;
  dispatch)
    # Pallas copy parity first (strict xfails: an XPASS means the Triton-pinned kernel works);
    # then pinned-host swaps, per-layer vs block-major pool (also with while loops in CUDA
    # graphs); then qwen3_omni host time with stacked layers under three runtime settings.
    timeout 120 python3 -m pytest -q -rxX -p no:cacheprovider tests/kv/test_kv_pallas.py 2>&1 | tail -8
    wh="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
    echo "== swap default"; timeout 60 python3 tools/explore_swap.py 2>&1 | tail -9
    echo "== swap $wh"; XLA_FLAGS=$wh timeout 60 python3 tools/explore_swap.py 2>&1 | tail -9
    echo "== qwen3 (stacked layers) default"; timeout 75 python3 tools/explore_dispatch.py 2>&1 | tail -10
    echo "== qwen3 (stacked layers) $wh"
    XLA_FLAGS=$wh timeout 75 python3 tools/explore_dispatch.py 2>&1 | tail -10
    echo "== qwen3 (stacked layers) tfrt client"
    XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 timeout 75 python3 tools/explore_dispatch.py \
      2>&1 | tail -10
    ;;
  followup)
    # The kv proofs on the GPU (sync-freedom, fresh copies, both compiled copy kernels), then
    # the open kv questions: h2d coalescing and the Mosaic GPU kernel's speed.
    timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/kv \
      -k "sync_free or fresh_copy or pallas" 2>&1 | grep -E "^E |FAILED|passed|failed" | head -30
    timeout 120 jaxsync verify --paths kv 2>&1 | tee "$out/verify-kv.txt" | tail -11
    # (The unroll sweep 8/16/32/64 ran on 2026-11-29: no gain past 8.) What coalescing
    # consecutive pool ids could gain for host->device swaps:
    echo "== pool swaps, and h2d in runs of consecutive pool ids"
    timeout 110 python3 tools/explore_swap.py --pool-only --runs --prototypes pallas_host,pallas_host_plain,pipelined32 --hlo "$out/hlo" 2>&1 | grep -E "ceiling|pool|equal"
    tar czf "$out/hlo.tgz" -C "$out" hlo && rm -rf "$out/hlo"
    echo "== copy kernels: Triton vs Mosaic GPU vs XLA"
    timeout 100 python3 tools/explore_mosaic.py --tiles 8192 32768 2>&1 | grep -v cuda_timer
    ;;
  h2dhost)
    # h2d with per-layer Triton kernels reading the pinned pool directly (tools/swap_prototypes.py
    # pallas_host_read), with and without the operand memory-space request; 512 and 64 blocks.
    for b in ${BLOCKS:-512 64}; do
      timeout 150 python3 tools/explore_swap.py --pool-only --blocks $b \
        --prototypes pallas_host,pallas_host_plain --hlo "$out/hlo$b" 2>&1 | grep -E "ceiling|pool|equal|GPU"
    done
    tar czf "$out/hlo.tgz" -C "$out" hlo512 hlo64 2>/dev/null; rm -rf "$out"/hlo512 "$out"/hlo64
    ;;
  kvhost)
    # Host time of one copy_blocks call, split, with the id upload's parts and a pinned-host
    # upload route, under both runtime clients.
    echo "== default client"; timeout 120 python3 tools/explore_kv_host.py --uploads 2>&1 | tail -10
    echo "== tfrt client"
    XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 timeout 120 python3 tools/explore_kv_host.py --uploads \
      2>&1 | tail -10
    ;;
  h2dflags)
    # Pool swaps under XLA flags that may put more host reads in flight (GPU only).
    for f in "" --xla_gpu_experimental_parallel_async_compute_limit=8 \
        --xla_gpu_executable_num_compute_streams=4 --xla_gpu_enable_pipelined_host_offloading=true \
        --xla_gpu_enable_highest_priority_async_stream=false --xla_gpu_disable_multi_streaming=true; do
      echo "== XLA_FLAGS=$f"
      XLA_FLAGS=$f timeout 60 python3 tools/explore_swap.py --pool-only 2>&1 | grep -E "pool|rror"
    done
    ;;
  suite1 | suite2)
    # The CPU suite (not gpu-marked) on the GPU: it must hold on any backend. suite1 is the model
    # tests (~400 s on an H200, 2026-11-29), suite2 the core tests; tests/kv runs in `check`.
    if [ "$phase" = suite1 ]; then what=tests/models; t=520; else what="tests --ignore=tests/models --ignore=tests/kv"; t=300; fi
    # shellcheck disable=SC2086
    timeout "$t" python3 -m pytest -q -p no:cacheprovider --tb=short -m "not gpu" $what 2>&1 \
      | grep -vi cuda_timer | grep -E "^E |^FAILED|^ERROR|passed|failed|^tests/.*Error" | head -60
    ;;
  host)
    # qwen3_omni host time under the TFRT client: the bench (packed rows, the default, against
    # unpacked, per-layer and flat weights and transformers; median of 11), then a call split
    # into steps and other ways to dispatch it, with trivial programs of 1..6 arguments.
    export XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1
    timeout 220 jaxsync bench --paths qwen3_omni --sizes released --repeat 11 \
      --out "$out/bench/qwen3_omni" 2>&1 | grep -vi cuda_timer | tail -8
    tar czf "$out/bench-host.tgz" -C "$out" bench && rm -rf "$out/bench"
    timeout 200 python3 tools/explore_dispatch.py --packed --stages --variants 2>&1 \
      | grep -vi cuda_timer | tail -34
    ;;
  hostflags)
    # The lead left by the eighth session: executables with the same argument count differed
    # in host dispatch under the TFRT client. XLA:GPU command-buffer (CUDA graph) settings were
    # only ever tried under the default client; here they run under TFRT, the variants each.
    export XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1
    for f in "" --xla_gpu_enable_command_buffer= --xla_gpu_graph_min_graph_size=1 \
        --xla_gpu_graph_min_graph_size=100; do
      echo "== XLA_FLAGS=$f"
      XLA_FLAGS=$f timeout 120 python3 tools/explore_dispatch.py --packed --variants 2>&1 \
        | grep -vi cuda_timer | grep -E "device time|variant (whole call |jit |trivial program, same)"
    done
    # Does the cold call wait for a core to wake? The variants again with the CPUs kept out of
    # deep idle states (/dev/cpu_dma_latency held at 0, where the container allows it).
    echo "== --dma-latency"
    timeout 150 python3 tools/explore_dispatch.py --packed --variants --dma-latency 2>&1 \
      | grep -vi cuda_timer | grep -E "cpuidle|==|variant (whole call|jit|trivial program, [13] )"
    ;;
  tfrt)
    # jaxsync recommends the TFRT client to host-bound servers: every path must hold under it.
    export XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1
    timeout 300 jaxsync verify 2>&1 | grep -vi cuda_timer | tee "$out/verify-tfrt.txt"
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu tests 2>&1 \
      | grep -vi cuda_timer | grep -E "^E |^FAILED|^ERROR|passed|failed" | tee "$out/gpu-tests-tfrt.log"
    ;;
  sharded)
    # Every GPU of the machine: the sharded kv / DeviceCache tests (jaxsync.testing.device_mesh
    # takes all of them), then tools/bench_kv_sharded.py. NVLink multicast stays off.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi topo -m 2>&1 | tee "$out/topology.txt"
    timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/kv \
      tests/test_device_cache.py 2>&1 | grep -E "^E |FAILED|passed|failed" | tee "$out/sharded-tests.log"
    timeout 150 python3 tools/bench_kv_sharded.py --out "$out/kv-sharded.json" 2>&1 | tail -8
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
