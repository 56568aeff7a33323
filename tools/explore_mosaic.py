"""Mosaic GPU block copy vs the Triton kernel vs XLA (GPU exploration, not a test).

Released KV workload (32 layers x 4096 blocks x 64 KiB, bf16): device ms and host-blocked ms of
`copy_blocks` with impl "pallas" (Triton), "mosaic" at several `kv._mosaic.TILE_BYTES`, and "xla",
next to a same-size JAX copy, in one process; then bitwise parity of "mosaic" against "xla".

  python tools/explore_mosaic.py [--counts 512 2048] [--tiles 8192 32768 65536]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync.bench._timing import _Side, measure
from jaxsync.kv import _mosaic, copy_blocks
from jaxsync.kv._layout import KVLayout


_copy = jax.jit(lambda x: x + 0)  # a same-size contiguous copy: the ceiling


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--tiles", type=int, nargs="*", default=[8192, 32768, 65536])
    args = ap.parse_args()
    layout = KVLayout(kind="packed", num_blocks=4096, block_size=16, num_kv_heads=8,
                      head_dim=128, dtype=jnp.bfloat16)  # fmt: skip
    names = [f"layer{i:02d}" for i in range(32)]
    src = layout.random(names, jax.random.key(0))
    state = {"dst": layout.random(names, jax.random.key(1))}
    side = _Side("jax")
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for count in args.counts:
        ids = [(rng.choice(4096, count, replace=False), rng.choice(4096, count, replace=False))
               for _ in range(4)]  # fmt: skip
        nbytes = 2 * count * layout.block_nbytes * len(names)
        flat = jnp.ones((nbytes // 4,), jnp.bfloat16)
        m = measure(lambda flat=flat: _copy(flat), side, repeat=3)
        print(f"{count} blocks: JAX copy of the same bytes {m['device_ms']:.3f} ms", flush=True)
        variants = [("pallas", None)] + [("mosaic", t) for t in args.tiles] + [("xla", None)]
        for impl, tile in variants:
            if tile:
                _mosaic.TILE_BYTES = tile
                jax.clear_caches()  # the tile is read at trace time
            it = iter(range(1 << 30))

            def fn(impl=impl, it=it, ids=ids):
                s, d = ids[next(it) % 4]
                state["dst"] = copy_blocks(src, state["dst"], s, d, impl=impl)
                return state["dst"]

            try:
                m = measure(fn, side, repeat=3)
            except Exception as e:  # report and go on: this is an exploration
                print(f"  {impl} tile {tile}: FAILED {e!r:.300}", flush=True)
                continue
            print(f"  {impl:7s} tile {tile!s:6s} device {m['device_ms']:.3f} ms | blocked "
                  f"{m['blocked_ms']:.3f} ms | first {m['first_call_ms']:.0f} ms",
                  flush=True)  # fmt: skip
    s, d = ids[0]
    for tile in args.tiles:
        _mosaic.TILE_BYTES = tile
        jax.clear_caches()
        base = layout.random(names, jax.random.key(2))
        want = copy_blocks(src, jax.tree.map(jnp.copy, base), s, d, impl="xla")
        got = copy_blocks(src, base, s, d, impl="mosaic")
        same = all(bool(jnp.array_equal(got[n], want[n])) for n in names)
        print(f"mosaic tile {tile} equals xla bit for bit: {same}", flush=True)


if __name__ == "__main__":
    main()
