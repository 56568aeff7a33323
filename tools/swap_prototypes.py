"""h2d swap prototypes for tools/explore_swap.py (GPU exploration, not library code).

Each is another shape of the pinned-host -> device program that `jaxsync.kv.swap_in` runs, kept
so the measurements in docs/benchmarks.md (fifth session) can be re-run. Each prototype
`impl(blocks, leaves, src, dst) -> leaves` takes the pool's `[P_host, L, *block]` pinned array,
the cache's leaves (donated) and the packed int32 ids.
"""

from __future__ import annotations

import functools as ft
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync.kv import _pool


HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def _direct(blocks, leaves, src, dst):
    """No staging: one DMA per block, then L in-place updates of that block into the layers."""

    def body(k, xs):
        block = jax.lax.dynamic_slice_in_dim(blocks, src[k], 1, axis=0)  # [1, L, ...]
        block = jax.device_put(block, DEVICE)
        return [jax.lax.dynamic_update_slice_in_dim(x, block[:, i], dst[k], axis=0)
                for i, x in enumerate(xs)]  # fmt: skip

    return jax.lax.fori_loop(0, src.shape[0], body, leaves, unroll=_pool.UNROLL)


def _pipelined(blocks, leaves, src, dst, chunk: int):
    """Chunks of `chunk` DMAs into a small staging buffer; each loop step also scatters the
    previous chunk into the layers, so the scatter can run beside the DMAs (XLA issues the
    host reads as async slices) instead of after all of them."""
    n = src.shape[0]
    stage = jnp.zeros((chunk, *blocks.shape[1:]), blocks.dtype)
    num = leaves[0].shape[0]
    dst_pad = jnp.concatenate([jnp.full((chunk,), num, dst.dtype), dst])  # step 0 drops its scatter

    def scatter(xs, st, ids):
        return [x.at[ids].set(st[:, i], mode="drop", unique_indices=True) for i, x in enumerate(xs)]

    def body(j, carry):
        xs, prev = carry
        xs = scatter(xs, prev, jax.lax.dynamic_slice_in_dim(dst_pad, j * chunk, chunk))
        st = prev
        for u in range(chunk):
            block = jax.lax.dynamic_slice_in_dim(blocks, src[j * chunk + u], 1, axis=0)
            st = jax.lax.dynamic_update_slice_in_dim(st, jax.device_put(block, DEVICE), u, axis=0)
        return xs, st

    xs, last = jax.lax.fori_loop(0, n // chunk, body, (leaves, stage))
    return scatter(xs, last, dst[n - chunk :])


def _gather(blocks, leaves, src, dst):
    """One gather of the pool's blocks, then one transfer. XLA (jax 0.11.2, H200) marks the
    gather host compute: it writes its result to pinned memory before the transfer, so the bytes
    cross PCIe twice (45.8 ms against swap_in's 24.5 ms for 512 blocks)."""
    src = jax.device_put(src, HOST)  # jax wants the gather's operands in one memory space
    staging = jax.device_put(blocks.at[src].get(mode="clip"), DEVICE)  # [N, L, ...]
    return [x.at[dst].set(staging[:, i], unique_indices=True) for i, x in enumerate(leaves)]


def pallas_host_read(blocks, leaves, src, dst, *, memory_space: int | None = 5, interpret=False):
    """One Triton kernel per layer reading its blocks straight out of the pinned pool: every
    block in flight at once, no staging buffer, no scatter. `interpret=True` runs the same kernel
    in Pallas' interpreter on a device-resident pool (the kernel's logic, on CPU).

    Settled on an H200 (jax 0.11.2, 2026-11-29, `gpu_session.sh h2dhost`): the operand
    memory-space request (frontend attribute `operands_memory_spaces`, openxla/xla#39742; 5 is
    XLA's host memory space) is refused ("Invalid memory space 5. Valid values are 0 (default),
    1 (collective), 2 (temp)"). Without it ("pallas_host_plain"), XLA passes the pinned pool
    (`S(5)`) to the Triton call unchanged and the kernel reads it over PCIe: 21.08 ms for 512
    blocks against 19.39 ms for one 1 GiB transfer (92%), bit-identical to swap_in. That is now
    `swap_in`'s GPU default (`kv._pool._swap_in_kernel`)."""
    from contextlib import nullcontext

    from jax.experimental.xla_metadata import set_xla_metadata

    from jaxsync.kv import _pallas

    backend = "interpret" if interpret else "triton"
    attr = {"operands_memory_spaces": f"{{2:{memory_space}}}"} if memory_space is not None else {}
    with set_xla_metadata(**attr) if attr else nullcontext():
        return [
            _pallas.copy_leaf(blocks, x, src, dst, backend, leaf=i) for i, x in enumerate(leaves)
        ]


PROTOTYPES = {
    "direct": _direct,
    "pipelined8": ft.partial(_pipelined, chunk=8),
    "pipelined32": ft.partial(_pipelined, chunk=32),
    "gather": _gather,
    "pallas_host": pallas_host_read,  # GPU only
    "pallas_host_plain": ft.partial(pallas_host_read, memory_space=None),  # GPU only
}


def prototype(pool, dest, ids, impl):
    """A jitted h2d prototype `impl(blocks, leaves, src, dst) -> leaves` on the pool, called
    like `swap_in` (ids packed in one upload, the cache donated)."""
    names = sorted(dest["d"])
    it = iter(range(1 << 30))

    @ft.partial(jax.jit, donate_argnums=1)
    def swap(blocks, leaves, ids):
        return impl(blocks, leaves, ids["src"], ids["dst"])

    def fn():
        s, d = ids[next(it) % len(ids)]
        packed = jaxsync.upload_packed({"src": s.astype(np.int32), "dst": d.astype(np.int32)})
        fn.last = (swap, lambda: (pool["p"].blocks, [dest["d"][k] for k in names], packed))
        out = swap(pool["p"].blocks, [dest["d"][k] for k in names], packed)
        dest["d"] = dict(zip(names, out, strict=True))
        return out

    return fn


def runs_h2d(pool, dest, n: int, run: int):
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
        args = (pool["p"].blocks, [dest["d"][k] for k in names], ids)
        fn.last = (swap, lambda: (pool["p"].blocks, [dest["d"][k] for k in names], ids))
        out = swap(*args)
        dest["d"] = dict(zip(names, out, strict=True))
        return out

    return fn


def _wall_ms(fn, k: int = 8) -> float:
    """Wall-clock ms per call of `k` back-to-back calls (transfers on their own streams count)."""
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    outs = [fn() for _ in range(k)]
    jax.block_until_ready(outs[-1])
    return (time.perf_counter() - t0) * 1e3 / k


def blocklist(dev_cache, dest, names, ids, nbytes, flat_host, to_dev, pool_in) -> None:
    """A prototype pool kept as one pinned-host array per block `[L, *block]`: h2d is one
    batched `jax.device_put` of the N blocks (copy-engine transfers with host-known addresses),
    then one jitted stack + scatter per layer. Timed by wall clock, next to `swap_in` and the
    single transfer timed the same way."""
    pinned = flat_host.sharding
    stacked = jax.jit(lambda xs: jnp.stack([xs[k] for k in names], axis=1))(dev_cache)
    blocks = [jax.device_put(stacked[i], pinned) for i in range(stacked.shape[0])]
    jax.block_until_ready(blocks)
    del stacked
    on_dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    it = iter(range(1 << 30))

    @ft.partial(jax.jit, donate_argnums=1)
    def land(moved, leaves, dst):
        staging = jnp.stack(moved)  # [N, L, ...]
        return [x.at[dst].set(staging[:, i], unique_indices=True) for i, x in enumerate(leaves)]

    def fn():
        s, d = ids[next(it) % len(ids)]
        moved = jax.device_put([blocks[i] for i in s], on_dev)
        dst = jaxsync.upload_packed({"dst": d.astype(np.int32)})["dst"]
        out = land(moved, [dest["d"][k] for k in names], dst)
        dest["d"] = dict(zip(names, out, strict=True))
        return out

    def timed(name, f):
        ms = _wall_ms(f)
        print(f"{name:34s} wall {ms:8.3f} ms/call | {nbytes / ms / 1e6:6.1f} GB/s", flush=True)

    timed("wall: ceiling h2d (one transfer)", lambda: to_dev(flat_host))
    timed("wall: pool h2d (swap_in)", pool_in)
    timed("wall: block-list h2d", fn)
    t0 = time.perf_counter()
    fn()
    print(f"block-list h2d host time per call {(time.perf_counter() - t0) * 1e3:.3f} ms")
    s, d = ids[0]
    out = dict(zip(names, land(jax.device_put([blocks[i] for i in s], on_dev),
                               [dest["d"][k] for k in names],
                               jnp.asarray(d, jnp.int32)), strict=True))  # fmt: skip
    ok = all(np.array_equal(np.asarray(out[k][d]), np.asarray(dev_cache[k][s])) for k in names)
    dest["d"] = out
    print(f"block-list swap lands the source blocks: {ok}")
