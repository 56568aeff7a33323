"""Which pinned-host operation blocks the host while device work is queued (GPU diagnostic).

Not a test. Each line is the host ms one operation takes with ~30 ms of device work queued:
a swap_out with a ready pool, `fresh_copy` of a pinned cache (result kept), dropping a pinned
array (freeing pinned memory), a device -> pinned `device_put`, and a swap_out whose pool is
still pending behind the queue.

  python tools/diagnose_pinned.py
"""

from __future__ import annotations

import time

import jax

from jaxsync.check._probe import spin_for
from jaxsync.kv import KVLayout, host_pool, swap_out
from jaxsync.kv._layout import fresh_copy


def main() -> None:
    layout = KVLayout(kind="packed", num_blocks=256, block_size=16, num_kv_heads=8, head_dim=128)
    cache = layout.random([f"l{i}" for i in range(4)], jax.random.key(0))
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    spin = spin_for(jax.devices()[0], 30.0)
    ids = (list(range(64)), list(range(64)))
    keep = []

    def timed(name, fn):
        jax.block_until_ready(keep)
        busy = spin.run()
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        keep.append(out)
        jax.block_until_ready((busy, out))
        print(f"{name:42s} {ms:8.3f} ms host (of {spin.time_ms():.1f} ms queued)", flush=True)

    pool = host_pool(cache, 128)
    pool = swap_out(cache, pool, *ids)  # compile
    jax.block_until_ready(pool.blocks)
    for _ in range(2):
        pool = swap_out(cache, pool, *ids)
        timed("swap_out, ready pool (kept)", lambda p=pool: swap_out(cache, p, *ids))
        pool = keep.pop()
    host_cache = jax.device_put(cache, pinned)
    fresh_copy(host_cache)
    for _ in range(2):
        timed("fresh_copy of a pinned cache (kept)", lambda: fresh_copy(host_cache))
    for _ in range(2):
        victim = [jax.device_put(cache["l0"], pinned)]
        jax.block_until_ready(victim)
        timed("drop a pinned array", lambda v=victim: v.clear())
    for _ in range(2):
        timed("device_put device -> pinned", lambda: jax.device_put(cache["l1"], pinned))
    for _ in range(2):
        busy = spin.run()
        pending = swap_out(cache, pool, *ids)  # queued behind the spin
        t0 = time.perf_counter()
        pool = swap_out(cache, pending, *ids)
        ms = (time.perf_counter() - t0) * 1e3
        jax.block_until_ready((busy, pool.blocks))
        print(f"{'swap_out, pool pending behind the queue':42s} {ms:8.3f} ms host", flush=True)


if __name__ == "__main__":
    main()
