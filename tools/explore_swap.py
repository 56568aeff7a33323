"""Pinned-host swap speed: per-layer host caches vs a block-major host pool (GPU exploration).

Not a test. Prints device ms, host-blocked ms and GB/s of transfer for moving N blocks of every
layer between device caches and pinned host memory, next to the large pinned transfer ceiling
(one contiguous device_put of the same bytes each way), measured in the same process:

* "per-layer": `jaxsync.kv.copy_blocks` between `{layer: [P, ...]}` caches, one DMA per block and
  layer (L x N small DMAs);
* "pool": `jaxsync.kv.swap_out` / `swap_in` with a block-major `HostPool` `[P_host, L, ...]`,
  one DMA per block moving every layer's slice at once (N DMAs of L x block bytes).

  python tools/explore_swap.py [--tiny] [--blocks N] [--unroll K] [--pool-only] [--runs]
      [--prototypes direct,pipelined8,pipelined32,gather] [--hlo DIR]

--runs adds a prototype host->device swap for pool ids in runs of 4 and 16 consecutive blocks
(one DMA per run): what coalescing consecutive pool ids in `swap_in` could gain.

--prototypes a,b,... adds other shapes of the host->device program (see PROTOTYPES): "direct"
(no staging: each block's DMA result goes straight into every layer), "pipelined8/32" (chunks of
DMAs, each step also scattering the previous chunk, so the scatter can overlap the reads),
"gather" (one gather of the pool straight to the device, if XLA offloads it), "pallas_host" /
"pallas_host_plain" (GPU: per-layer Triton kernels reading the pinned pool directly, with and
without asking XLA to keep the pool in host memory).

--hlo DIR writes the optimized HLO of `swap_in` (and of the prototypes) to DIR.

--unroll K unrolls the pool's DMA loops K times (`jaxsync.kv._pool.UNROLL`).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from swap_prototypes import PROTOTYPES, blocklist, prototype, runs_h2d

import jaxsync
from jaxsync.bench._timing import _Side, measure
from jaxsync.kv import _pool, copy_blocks, host_pool, swap_in, swap_out
from jaxsync.kv._layout import KVLayout


def main() -> None:
    tiny = "--tiny" in sys.argv
    n = int(sys.argv[sys.argv.index("--blocks") + 1]) if "--blocks" in sys.argv else 512
    layers = 4 if tiny else 32
    layout = KVLayout(kind="packed", num_blocks=64 if tiny else 1024, block_size=16,
                      num_kv_heads=2 if tiny else 8, head_dim=8 if tiny else 128)  # fmt: skip
    n = min(n, layout.num_blocks // 2)
    if "--unroll" in sys.argv:
        _pool.UNROLL = int(sys.argv[sys.argv.index("--unroll") + 1])
    names = sorted(f"layer{i:02d}" for i in range(layers))
    dev = jax.devices()[0]
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    pinned = on_dev.with_memory_kind("pinned_host")
    side = _Side("jax")
    nbytes = n * layers * layout.block_nbytes  # transferred bytes, one way
    rng = np.random.default_rng(0)
    ids = [(rng.choice(layout.num_blocks, n, replace=False),
            rng.choice(layout.num_blocks, n, replace=False)) for _ in range(4)]  # fmt: skip

    def report(name, fn):
        m = measure(fn, side, repeat=3)
        gbps = nbytes / max(m["device_ms"] * 1e-3, 1e-9) / 1e9
        print(f"{name:34s} device {m['device_ms']:8.3f} ms | blocked {m['blocked_ms']:7.3f} ms | "
              f"{gbps:6.1f} GB/s | first {m['first_call_ms']:.0f} ms", flush=True)  # fmt: skip

    # Ceilings: one contiguous transfer of the same bytes.
    flat_dev = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), on_dev)
    flat_host = jax.device_put(flat_dev, pinned)
    to_host = jax.jit(lambda x: x, out_shardings=pinned)
    to_dev = jax.jit(lambda x: x, out_shardings=on_dev)
    report("ceiling d2h (one transfer)", lambda: to_host(flat_dev))
    report("ceiling h2d (one transfer)", lambda: to_dev(flat_host))

    dev_cache = layout.random(names, jax.random.key(0), placement=on_dev)
    host_cache = layout.random(names, jax.random.key(1), placement=pinned)
    state = {
        "d2h": layout.random(names, jax.random.key(4), placement=pinned),
        "h2d": layout.random(names, jax.random.key(3), placement=on_dev),
    }
    it = iter(range(10**9))

    def per_layer(direction):
        s, d = ids[next(it) % 4]
        src = dev_cache if direction == "d2h" else host_cache
        state[direction] = copy_blocks(src, state[direction], s, d)
        return state[direction]

    if "--pool-only" not in sys.argv:
        report(f"per-layer d2h {n} blocks", lambda: per_layer("d2h"))
        report(f"per-layer h2d {n} blocks", lambda: per_layer("h2d"))

    pool = {"p": host_pool(dev_cache, layout.num_blocks)}
    dest = {"d": layout.random(names, jax.random.key(2), placement=on_dev)}

    def pool_out():
        pool["p"] = swap_out(dev_cache, pool["p"], *ids[next(it) % 4])
        return pool["p"].blocks

    def pool_in():
        dest["d"] = swap_in(pool["p"], dest["d"], *ids[next(it) % 4])
        return dest["d"]

    zeros = np.zeros(n, np.int32)  # the library's jitted swap_in, for --hlo

    def live_args():
        ids = jaxsync.upload_packed({"src": zeros, "dst": zeros})
        return pool["p"].blocks, [dest["d"][k] for k in names], ids

    pool_in.last = (_pool._swap_in, live_args)

    report(f"pool d2h {n} blocks", pool_out)
    report(f"pool h2d {n} blocks", pool_in)
    hlo = sys.argv[sys.argv.index("--hlo") + 1] if "--hlo" in sys.argv else None
    if hlo:
        _dump(hlo, "swap_in", pool_in)
    protos = []
    if "--prototypes" in sys.argv:
        protos = sys.argv[sys.argv.index("--prototypes") + 1].split(",")
    if jax.default_backend() != "gpu" and any(p.startswith("pallas_host") for p in protos):
        print("pallas_host prototypes compile Triton kernels: GPU only, skipped")
        protos = [p for p in protos if not p.startswith("pallas_host")]
    for name in protos:  # other shapes of the h2d program (prototypes)
        fn = prototype(pool, dest, ids, PROTOTYPES[name])
        try:
            report(f"pool h2d {n} blocks, {name}", fn)
        except Exception as e:  # noqa: BLE001 - a prototype XLA refuses is a result too
            print(f"pool h2d {n} blocks, {name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        if hlo:
            _dump(hlo, name, fn)
    if "--runs" in sys.argv:  # what coalescing consecutive pool ids could gain (prototype)
        for run in (4, 16):
            fn = runs_h2d(pool, dest, n, run)
            report(f"pool h2d {n} blocks, runs of {run}", fn)
            if hlo:
                _dump(hlo, f"runs{run}", fn)
    if "--blocklist" in sys.argv:
        blocklist(dev_cache, dest, names, ids, nbytes, flat_host, to_dev, pool_in)
    # Parity of the pool round trip against the source blocks (one id set).
    s, d = ids[0]
    pool["p"] = swap_out(dev_cache, pool["p"], s, d)
    back = dest["d"] = swap_in(pool["p"], dest["d"], d, s)
    ok = all(bool(jnp.array_equal(back[nm][s], dev_cache[nm][s])) for nm in names)
    print(f"pool round trip equal: {ok}")
    for name in protos:  # each prototype lands the same blocks as swap_in
        dest["d"] = swap_in(pool["p"], dest["d"], d, s)
        ref = {k: np.asarray(v) for k, v in dest["d"].items()}
        dest["d"] = {k: v + 1 for k, v in dest["d"].items()}  # a prototype must overwrite
        try:
            out = prototype(pool, dest, [(d, s)], PROTOTYPES[name])()
        except Exception as e:  # noqa: BLE001
            print(f"{name} swap equal to swap_in: error {type(e).__name__}: {str(e)[:200]}")
            continue
        ok = all(
            np.array_equal(np.asarray(x[s]), ref[k][s]) for k, x in zip(names, out, strict=True)
        )
        print(f"{name} swap equal to swap_in: {ok}")


def _dump(folder: str, name: str, fn) -> None:
    """Writes the optimized HLO of the last jitted program `fn` ran."""
    import os

    os.makedirs(folder, exist_ok=True)
    jitted, args = fn.last  # (jitted function, a thunk of live arguments)
    text = jitted.lower(*args()).compile().as_text()
    with open(os.path.join(folder, f"{name}.hlo.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
