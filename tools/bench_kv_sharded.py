"""KV block copies and swaps with caches sharded over kv heads on every local GPU (multi-GPU run).

Per GPU, measured in one process with `jaxsync.harness.bench._timing.measure` (device time from
queued back-to-back calls, host-blocked time with ~30 ms of work queued):

* d2d `copy_blocks`, default impl ("auto": the Pallas kernel per shard under shard_map on GPUs)
  and impl="xla", against a per-GPU device copy ceiling (every GPU
  copying 1 GiB at once);
* `swap_out` / `swap_in` through a `HostPool` sharded like the cache, and `copy_blocks` from
  per-layer pinned caches sharded the same way (h2d layers), against a per-GPU pinned
  transfer ceiling (one sharded device_put of 1 GiB per GPU, every GPU on its own link, timed
  by wall clock).

Bytes: d2d counts read + written of the copied blocks, swaps the bytes moved one way; both per
GPU. Usage: python tools/bench_kv_sharded.py [--layers 32] [--blocks 4096] [--counts 64 512 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time


os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxsync.harness.bench._timing import _Side, copy_ceiling_gbps, measure  # noqa: E402
from jaxsync.kv import KVLayout, copy_blocks, host_pool, swap_in, swap_out  # noqa: E402
from jaxsync.testing import fresh_copy  # noqa: E402


def _pinned_ceiling(mesh, nbytes_per_gpu: int, to_host: bool) -> float:
    """GB/s per GPU of one sharded pinned <-> device transfer of `nbytes_per_gpu` per GPU.

    Wall time from the call to the last byte, median of 5: a transfer runs on its own stream,
    so `measure`'s queued busy work (a kernel on the first GPU) would overlap it and inflate the
    rate (a PCIe link cannot carry more)."""
    dev = NamedSharding(mesh, P("h"), memory_kind="device")
    host = dev.with_memory_kind("pinned_host")
    x = jax.device_put(jnp.zeros((mesh.size * nbytes_per_gpu // 2,), jnp.bfloat16), dev)
    src, target = (x, host) if to_host else (jax.device_put(x, host), dev)
    jax.block_until_ready(jax.device_put(src, target))  # warm-up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(src, target))
        times.append(time.perf_counter() - t0)
    return nbytes_per_gpu / statistics.median(times) / 1e9


def _closures(src, state, ids, host_ids):
    """Zero-arg calls for `measure`, rotating over 4 id sets; donated caches live in `state`."""
    it = iter(range(1 << 30))

    def d2d(impl):
        def fn():
            s, d = ids[next(it) % 4]
            state["dst"] = copy_blocks(src, state["dst"], s, d, impl=impl)
            return state["dst"]

        return fn

    def out():
        s, d = host_ids[next(it) % 4]
        state["pool"] = swap_out(src, state["pool"], s, d)
        return state["pool"].blocks

    def back(impl):
        def fn():
            d, s = host_ids[next(it) % 4]
            state["dst"] = swap_in(state["pool"], state["dst"], s, d, impl=impl)
            return state["dst"]

        return fn

    def h2d(impl):  # per-layer pinned caches -> device caches
        def fn():
            d, s = host_ids[next(it) % 4]
            state["dst"] = copy_blocks(state["host"], state["dst"], s, d, impl=impl)
            return state["dst"]

        return fn

    return d2d, out, back, h2d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--host-blocks", type=int, default=2048)
    ap.add_argument("--counts", type=int, nargs="*", default=[64, 512, 2048])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("h",), devices=devices)
    shard = NamedSharding(mesh, P(None, "h"))  # [P, K, S, 2H] split over kv heads
    layout = KVLayout(kind="packed", num_blocks=args.blocks, block_size=16,
                      num_kv_heads=args.heads, head_dim=args.head_dim,
                      dtype=jnp.bfloat16)  # fmt: skip
    names = [f"layer{i:02d}" for i in range(args.layers)]
    src = layout.random(names, jax.random.key(0), placement=shard)
    state = {"dst": layout.random(names, jax.random.key(1), placement=shard)}
    state["pool"] = host_pool(src, args.host_blocks)
    host_layout = dataclasses.replace(layout, num_blocks=args.host_blocks)
    state["host"] = fresh_copy(host_layout.random(names, jax.random.key(2), placement=shard),
                               "pinned_host")  # fmt: skip
    side = _Side("jax")
    ceiling = copy_ceiling_gbps("jax", 1 << 30, mesh=mesh)
    per_gpu_block = layout.block_nbytes * args.layers / mesh.size
    pinned = {}
    rng = np.random.default_rng(0)
    rows = []
    for count in args.counts:
        ids = [(rng.choice(args.blocks, count, replace=False),
                rng.choice(args.blocks, count, replace=False)) for _ in range(4)]  # fmt: skip
        host_ids = [(s, rng.choice(args.host_blocks, count, replace=False)) for s, _ in ids]
        d2d, out, back, h2d = _closures(src, state, ids, host_ids)
        cases = [("d2d", "auto", d2d("auto"), ceiling, 2), ("d2d", "xla", d2d("xla"), ceiling, 2)]
        if count <= args.host_blocks // 2:
            swaps = (("d2h pool", "pool", out, True), ("h2d pool", "auto", back("auto"), False),
                     ("h2d pool", "xla", back("xla"), False), ("h2d layers", "auto", h2d("auto"),
                     False), ("h2d layers", "xla", h2d("xla"), False))  # fmt: skip
            for name, impl, fn, to_host in swaps:
                if to_host not in pinned:
                    pinned[to_host] = _pinned_ceiling(mesh, 1 << 30, to_host)
                cases.append((name, impl, fn, pinned[to_host], 1))
        for what, impl, fn, ref, passes in cases:
            m = measure(fn, side, repeat=3)
            gbps = passes * count * per_gpu_block / max(m["device_ms"] * 1e-3, 1e-9) / 1e9
            kept = all(x.sharding.is_equivalent_to(shard, x.ndim)
                       for x in jax.tree.leaves(state["dst"]))  # fmt: skip
            rows.append(dict(copy=what, impl=impl, blocks=count, gbps_per_gpu=gbps,
                             pct_ceiling=100 * gbps / ref, ceiling_gbps_per_gpu=ref,
                             device_ms=m["device_ms"], blocked_ms=m["blocked_ms"],
                             sharding_kept=kept))  # fmt: skip
            print(f"{what} {impl} {count}: {gbps:.0f} GB/s/GPU = {100 * gbps / ref:.0f}% "
                  f"of {ref:.0f}; device {m['device_ms']:.3f} ms, blocked "
                  f"{m['blocked_ms']:.3f} ms", flush=True)  # fmt: skip
    result = dict(devices=[d.device_kind for d in devices], gpus=mesh.size,
                  copy_ceiling_gbps_per_gpu=ceiling, pinned_ceiling_gbps_per_gpu=pinned,
                  jax=jax.__version__, layers=args.layers, rows=rows)  # fmt: skip
    print(f"{mesh.size} x {devices[0].device_kind}, jax {jax.__version__}; per-GPU copy ceiling "
          f"{ceiling:.0f} GB/s")  # fmt: skip
    print("| copy | impl | blocks | GB/s per GPU | % ceiling | device ms | host-blocked ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['copy']} | {r['impl']} | {r['blocks']} | {r['gbps_per_gpu']:.0f} | "
              f"{r['pct_ceiling']:.0f}% | {r['device_ms']:.3f} | "
              f"{r['blocked_ms']:.3f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
