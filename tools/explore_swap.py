"""Pinned-host swap speed: per-layer host caches vs a block-major host pool (GPU exploration).

Not a test. Prints device ms, host-blocked ms and GB/s of transfer for moving N blocks of every
layer between device caches and pinned host memory, next to the large pinned transfer ceiling
(one contiguous device_put of the same bytes each way), measured in the same process:

* "per-layer": `jaxsync.kv.copy_blocks` between `{layer: [P, ...]}` caches, one DMA per block and
  layer (L x N small DMAs);
* "pool": a block-major host pool `[P_host, L, ...]`, one DMA per block moving every layer's
  slice at once (N DMAs of L x block bytes) through a device staging buffer `[N, L, ...]` that is
  gathered / scattered per layer on the device.

  python tools/explore_swap.py [--tiny] [--blocks N]
"""

from __future__ import annotations

import functools as ft
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync.bench._timing import _Side, measure
from jaxsync.kv import copy_blocks
from jaxsync.kv._layout import KVLayout


HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


@ft.partial(jax.jit, donate_argnames="dst")
def pool_to_device(pool, dst, ids):
    """pool: [Ph, L, ...] pinned host; dst: {layer: [P, ...]} device (donated)."""
    src_ids, dst_ids = ids["src"], ids["dst"]
    staging = jnp.zeros((src_ids.shape[0],) + pool.shape[1:], pool.dtype)  # [N, L, ...]

    def body(k, st):
        blk = jax.device_put(jax.lax.dynamic_slice_in_dim(pool, src_ids[k], 1, 0), DEVICE)
        return jax.lax.dynamic_update_slice_in_dim(st, blk, k, 0)

    staging = jax.lax.fori_loop(0, src_ids.shape[0], body, staging)
    names = sorted(dst)
    return {
        n: dst[n].at[dst_ids].set(staging[:, i], mode="drop", unique_indices=True)
        for i, n in enumerate(names)
    }


@ft.partial(jax.jit, donate_argnames="pool")
def device_to_pool(src, pool, ids):
    """src: {layer: [P, ...]} device; pool: [Ph, L, ...] pinned host (donated)."""
    src_ids, dst_ids = ids["src"], ids["dst"]
    names = sorted(src)
    staging = jnp.stack([src[n].at[src_ids].get(mode="clip") for n in names], axis=1)

    def body(k, p):
        blk = jax.device_put(jax.lax.dynamic_slice_in_dim(staging, k, 1, 0), HOST)
        return jax.lax.dynamic_update_slice_in_dim(p, blk, dst_ids[k], 0)

    return jax.lax.fori_loop(0, src_ids.shape[0], body, pool)


def main() -> None:
    tiny = "--tiny" in sys.argv
    n = int(sys.argv[sys.argv.index("--blocks") + 1]) if "--blocks" in sys.argv else 512
    layers = 4 if tiny else 32
    layout = KVLayout(kind="packed", num_blocks=64 if tiny else 1024, block_size=16,
                      num_kv_heads=2 if tiny else 8, head_dim=8 if tiny else 128)  # fmt: skip
    n = min(n, layout.num_blocks // 2)
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
        gbps = nbytes / (m["device_ms"] * 1e-3) / 1e9
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

    report(f"per-layer d2h {n} blocks", lambda: per_layer("d2h"))
    report(f"per-layer h2d {n} blocks", lambda: per_layer("h2d"))

    pool_shape = (layout.num_blocks, layers) + layout.leaf_shape[1:]
    pool = {"p": jax.device_put(jnp.zeros(pool_shape, layout.dtype), pinned)}
    dest = {"d": layout.random(names, jax.random.key(2), placement=on_dev)}

    def packed(s, d):
        return jaxsync.upload_packed({"src": np.asarray(s, np.int32),
                                      "dst": np.asarray(d, np.int32)})  # fmt: skip

    def pool_out():
        pool["p"] = device_to_pool(dev_cache, pool["p"], packed(*ids[next(it) % 4]))
        return pool["p"]

    def pool_in():
        dest["d"] = pool_to_device(pool["p"], dest["d"], packed(*ids[next(it) % 4]))
        return dest["d"]

    report(f"pool d2h {n} blocks", pool_out)
    report(f"pool h2d {n} blocks", pool_in)
    # Parity of the pool round trip against the source blocks (one id set).
    s, d = ids[0]
    pool["p"] = device_to_pool(dev_cache, pool["p"], packed(s, d))
    back = pool_to_device(pool["p"], dest["d"], packed(d, s))
    ok = all(bool(jnp.array_equal(back[nm][s], dev_cache[nm][s])) for nm in names)
    print(f"pool round trip equal: {ok}")
    t0 = time.perf_counter()
    text = pool_to_device.lower(pool["p"], back, packed(s, d)).compile().as_text()
    print(
        f"pool h2d HLO: {text.count('copy-start')} copy-start, "
        f"{text.count('dynamic-slice')} dynamic-slice ({time.perf_counter() - t0:.1f} s)"
    )


if __name__ == "__main__":
    main()
