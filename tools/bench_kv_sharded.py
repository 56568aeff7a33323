"""KV block copy with caches sharded over kv heads on every local GPU (issue: multi-GPU run).

Per GPU: effective GB/s (bytes read + written of the copied blocks, per device) against a per-GPU
device-to-device copy ceiling measured in the same run, and host time for copy_blocks to return.
Usage: python tools/bench_kv_sharded.py [--layers 32] [--blocks 4096] [--counts 64 512 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxsync.bench._timing import copy_ceiling_gbps  # noqa: E402
from jaxsync.kv import KVLayout, copy_blocks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--counts", type=int, nargs="*", default=[64, 512, 2048])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("h",), devices=devices)
    shard = NamedSharding(mesh, P(None, "h"))  # [P, K, S, 2H] split over kv heads
    layout = KVLayout(kind="packed", num_blocks=args.blocks, block_size=16, num_kv_heads=8,
                      head_dim=128, dtype=jnp.bfloat16)  # fmt: skip
    names = [f"layer{i}" for i in range(args.layers)]
    src = layout.random(names, jax.random.key(0), placement=shard)
    dst = layout.random(names, jax.random.key(1), placement=shard)
    ceiling = copy_ceiling_gbps("jax", 1 << 30, mesh=mesh)
    rng = np.random.default_rng(0)
    rows = []
    for count in args.counts:
        ids = [
            (
                rng.choice(args.blocks, count, replace=False),
                rng.choice(args.blocks, count, replace=False),
            )
            for _ in range(4)
        ]
        dst = copy_blocks(src, dst, *ids[0])  # compile the bucket
        jax.block_until_ready(dst)
        device_s, returned_ms = [], []
        for rep in range(8):
            s, d = ids[rep % 4]
            t0 = time.perf_counter()
            dst = copy_blocks(src, dst, s, d)
            t1 = time.perf_counter()
            jax.block_until_ready(dst)
            t2 = time.perf_counter()
            returned_ms.append((t1 - t0) * 1e3)
            device_s.append(t2 - t0)
        per_dev_bytes = 2 * count * layout.block_nbytes * args.layers / mesh.size
        gbps = per_dev_bytes / statistics.median(device_s) / 1e9
        shardings_kept = all(leaf.sharding == shard for leaf in jax.tree.leaves(dst))
        rows.append(dict(blocks=count, gbps_per_gpu=gbps, pct_ceiling=100 * gbps / ceiling,
                         copy_ms=1e3 * statistics.median(device_s),
                         returned_ms=statistics.median(returned_ms),
                         sharding_kept=shardings_kept))  # fmt: skip
    result = dict(devices=[d.device_kind for d in devices], gpus=mesh.size,
                  ceiling_gbps_per_gpu=ceiling, layers=args.layers, rows=rows)  # fmt: skip
    print(json.dumps(result, indent=2))
    print(f"{mesh.size} x {devices[0].device_kind}; per-GPU copy ceiling {ceiling:.0f} GB/s")
    print("| blocks | GB/s per GPU | % ceiling | copy ms | copy_blocks returned after ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['blocks']} | {r['gbps_per_gpu']:.0f} | {r['pct_ceiling']:.0f}% | "
              f"{r['copy_ms']:.2f} | {r['returned_ms']:.2f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
