"""Pinned-host swap speed: per-layer host caches vs a block-major host pool (GPU exploration).

Not a test. Prints device ms, host-blocked ms and GB/s of transfer for moving N blocks of every
layer between device caches and pinned host memory, next to the large pinned transfer ceiling
(one contiguous device_put of the same bytes each way), measured in the same process:

* "per-layer": `jaxsync.kv.copy_blocks` between `{layer: [P, ...]}` caches, one DMA per block and
  layer (L x N small DMAs);
* "pool": `jaxsync.kv.swap_out` / `swap_in` with a block-major `HostPool` `[P_host, L, ...]`,
  one DMA per block moving every layer's slice at once (N DMAs of L x block bytes).

  python tools/explore_swap.py [--tiny] [--blocks N] [--unroll K] [--pool-only] [--runs]

--runs adds a prototype host->device swap for pool ids in runs of 4 and 16 consecutive blocks
(one DMA per run): what coalescing consecutive pool ids in `swap_in` could gain.

--unroll K unrolls the pool's DMA loops K times (`jaxsync.kv._pool.UNROLL`).
"""

from __future__ import annotations

import functools as ft
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync.bench._timing import _Side, measure
from jaxsync.kv import _pool, copy_blocks, host_pool, swap_in, swap_out
from jaxsync.kv._layout import KVLayout


HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


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

    report(f"pool d2h {n} blocks", pool_out)
    report(f"pool h2d {n} blocks", pool_in)
    if "--runs" in sys.argv:  # what coalescing consecutive pool ids could gain (prototype)
        for run in (4, 16):
            report(f"pool h2d {n} blocks, runs of {run}", _runs_h2d(pool, dest, n, run))
    # Parity of the pool round trip against the source blocks (one id set).
    s, d = ids[0]
    pool["p"] = swap_out(dev_cache, pool["p"], s, d)
    back = swap_in(pool["p"], dest["d"], d, s)
    ok = all(bool(jnp.array_equal(back[nm][s], dev_cache[nm][s])) for nm in names)
    print(f"pool round trip equal: {ok}")


def _runs_h2d(pool, dest, n: int, run: int):
    """A prototype h2d swap for pool ids that come in runs of `run` consecutive blocks: one DMA
    per run (`run` x 2 MiB) into staging, then the same per-leaf scatter as `swap_in`. Random
    runs of the pool; ids go up packed like the library's."""
    rng = np.random.default_rng(1)
    num = pool["p"].num_blocks
    sets = []
    for _ in range(4):
        starts = rng.choice(num // run, n // run, replace=False) * run
        dst = rng.choice(dest["d"][next(iter(dest["d"]))].shape[0], n, replace=False)
        sets.append({"starts": starts.astype(np.int32), "dst": dst.astype(np.int32)})
    it = iter(range(1 << 30))

    @ft.partial(jax.jit, donate_argnums=1)
    def swap(blocks, leaves, ids):
        starts, dst = ids["starts"], ids["dst"]
        staging = jax.lax.empty((n, *blocks.shape[1:]), blocks.dtype)

        def body(j, st):
            piece = jax.lax.dynamic_slice_in_dim(blocks, starts[j], run, axis=0)  # [run, L, ...]
            piece = jax.device_put(piece, DEVICE)
            return jax.lax.dynamic_update_slice_in_dim(st, piece, j * run, axis=0)

        staging = jax.lax.fori_loop(0, n // run, body, staging, unroll=8)
        return [x.at[dst].set(staging[:, i], unique_indices=True) for i, x in enumerate(leaves)]

    names = sorted(dest["d"])

    def fn():
        ids = jaxsync.upload_packed(sets[next(it) % 4])
        out = swap(pool["p"].blocks, [dest["d"][k] for k in names], ids)
        dest["d"] = dict(zip(names, out, strict=True))
        return out

    return fn


if __name__ == "__main__":
    main()
