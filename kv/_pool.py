"""Block-major pinned-host swap space: `HostPool`, `host_pool`, `swap_out`, `swap_in`.

Why a second host layout. `copy_blocks` between per-layer caches moves one DMA per block *and*
layer: at 32 layers x 64 KiB blocks that is 16384 small DMAs for 512 blocks, far below the
bandwidth of one large pinned transfer. A `HostPool` stores host block b of *every* leaf
contiguously, `[P_host, L, *block]` (L = leaves of the cache in its flattened order: sorted layer
names, k before v), so one DMA moves a block of all layers. On GPUs XLA reads pinned memory at a
device-held offset with an SM kernel, a few at a time, so swap_in reads the pool from a Pallas
kernel instead, every block in flight at once (see docs/benchmarks.md for measured figures).

* `swap_out`: one gather per leaf on the device into a staging buffer `[N, L, *block]`, then one
  DMA per block into the (donated) pool.
* `swap_in`: on GPUs, one Pallas (Triton) kernel per leaf reading the pinned pool directly
  (`_swap_in_kernel`); elsewhere one DMA per block into a device staging buffer, then one
  scatter per leaf into the (donated) cache.

The loops have a static trip count (the bucket) for the reason given in `_copy`; padded entries
repeat the last real pair (an idempotent rewrite), and swap_in's scatter drops them through
out-of-range destination ids. All layers must share one block shape and dtype.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import jaxsync
from jaxsync.check import entry_point
from jaxsync.kv import _pallas
from jaxsync.kv._ids import checked_ids, host_int, padded_ids
from jaxsync.kv._layout import Cache, cache_leaves
from jaxsync.kv._placement import (
    check_placement,
    check_same_sharding,
    committed,
    memory_kind,
    same_sharding,
    upload_ids,
)


UNROLL = 8
"""DMA-loop iterations per unrolled step, read at trace time: unrolling lets consecutive block
DMAs overlap; beyond 8 the swaps measured no faster."""


@ft.partial(jax.tree_util.register_dataclass, data_fields=["blocks"], meta_fields=["treedef"])
@dataclasses.dataclass(frozen=True)
class HostPool:
    """Pinned-host swap space for caches of one structure.

    Attributes:
      blocks: `[P_host, L, *block]` in pinned host memory.
      treedef: the structure of the caches it serves (checked on every swap).
    """

    blocks: jax.Array
    treedef: Any

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]


def _block_spec(leaves: list[jax.Array], what: str) -> tuple[tuple[int, ...], Any]:
    specs = {(tuple(x.shape[1:]), jnp.dtype(x.dtype)) for x in leaves}
    if len(specs) != 1:
        raise ValueError(f"a host pool needs one block shape and dtype in all of {what}: {specs}")
    return next(iter(specs))


def _pool_sharding(leaf: jax.Array) -> jax.sharding.Sharding:
    """The leaf's placement with a new unsharded axis 1, in pinned host memory."""
    s = leaf.sharding
    if isinstance(s, SingleDeviceSharding):
        return s.with_memory_kind("pinned_host")
    if isinstance(s, NamedSharding):
        spec = tuple(s.spec) + (None,) * (leaf.ndim - len(s.spec))
        return NamedSharding(
            s.mesh, PartitionSpec(spec[0], None, *spec[1:]), memory_kind="pinned_host"
        )
    raise ValueError(f"cannot derive a host pool placement from {type(s).__name__}")


def host_pool(cache: Cache, num_blocks: int) -> HostPool:
    """A zeroed pinned-host pool of `num_blocks` blocks for caches shaped like `cache`
    (sharded like it, with the leaf axis unsharded). Setup, not hot path."""
    leaves, treedef = cache_leaves(cache, "cache")
    block, dtype = _block_spec(leaves, "cache")
    num_blocks = host_int(num_blocks, "num_blocks")  # a bool would make a 1-block pool
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    shape = (num_blocks, len(leaves), *block)
    target = _pool_sharding(leaves[0])
    # Zeros made on the device and moved: a jit with a pinned-host out_sharding returns an array
    # whose abstract memory space still says device, which the swap loops then reject.
    on_device = target.with_memory_kind("device")
    blocks = jax.device_put(
        jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=on_device)(), target
    )
    return HostPool(blocks, treedef)


def _check(pool: HostPool, cache: Cache) -> list[jax.Array]:
    """Validates the pair on the host; returns the cache's leaves."""
    if not isinstance(pool, HostPool):
        raise TypeError(f"pool must be a HostPool (see host_pool), got {type(pool).__name__}")
    if not isinstance(pool.blocks, jax.core.Tracer) and pool.blocks.is_deleted():
        raise ValueError("the pool was donated (deleted); use the HostPool swap_out returned")
    leaves, treedef = cache_leaves(cache, "cache")
    if memory_kind(leaves, "cache") != "device":
        raise ValueError("the cache must live in device memory")
    if memory_kind([pool.blocks], "pool") != "pinned_host":
        raise ValueError("the pool must live in pinned host memory")
    if treedef != pool.treedef:
        raise ValueError(f"the cache's layers {treedef} differ from the pool's {pool.treedef}")
    block, dtype = _block_spec(leaves, "cache")
    if tuple(pool.blocks.shape[2:]) != block or pool.blocks.dtype != dtype:
        raise ValueError(
            f"pool blocks {pool.blocks.shape[2:]} {pool.blocks.dtype} differ from the cache's "
            f"{block} {dtype}"
        )
    check_placement([pool.blocks, *leaves], "the pool and the cache")
    # Every layer sharded alike, and the pool like them with its leaf axis unsharded (as
    # `host_pool` places it): otherwise tracing fails (Explicit mesh axes) or the swap silently
    # hands the pool or the cache another sharding (Auto axes).
    check_same_sharding([(x, leaves[0]) for x in leaves[1:]], "the cache's layers")
    blocks = pool.blocks
    if not isinstance(blocks, jax.core.Tracer) and len(blocks.sharding.device_set) > 1:
        if not same_sharding(blocks, blocks, _pool_sharding(leaves[0])):
            raise ValueError(
                f"the pool ({blocks.sharding}) is not placed like the cache "
                f"({leaves[0].sharding}) with an unsharded leaf axis; make it with host_pool"
            )
    return leaves


@ft.partial(jax.jit, donate_argnames="pool")
def _swap_out(leaves: list[jax.Array], pool: jax.Array, ids: jaxsync.Packed) -> jax.Array:
    src_ids, dst_ids = ids["src"], ids["dst"]  # [N] each
    staging = jnp.stack([x.at[src_ids].get(mode="clip") for x in leaves], axis=1)  # [N, L, ...]

    def body(k, p):
        block = jax.lax.dynamic_slice_in_dim(staging, k, 1, axis=0)  # [1, L, ...]
        block = jax.device_put(block, jax.memory.Space.Host)
        return jax.lax.dynamic_update_slice_in_dim(p, block, dst_ids[k], axis=0)

    return jax.lax.fori_loop(0, src_ids.shape[0], body, pool, unroll=UNROLL)


def _staging_sharding(leaf: jax.Array) -> NamedSharding | None:
    """`[N, L, *block]` sharded like the cache leaf's block axes (explicit mesh axes type-check
    the loop's update against it). Taken from the device leaf, not the pool: zeros placed like the
    pinned-host pool came out unsharded on multi-GPU hosts."""
    sharding = jax.typeof(leaf).sharding
    if sharding.mesh.empty:
        return None
    spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(None, None, *spec[1:]))


@ft.partial(jax.jit, donate_argnames="leaves")
def _swap_in(pool: jax.Array, leaves: list[jax.Array], ids: jaxsync.Packed) -> list[jax.Array]:
    src_ids, dst_ids = ids["src"], ids["dst"]  # [N] each; padded dst ids are out of range
    # Uninitialized (no memset of N blocks on GPUs): the loop writes every row, padding included.
    staging = jax.lax.empty(
        (src_ids.shape[0], *pool.shape[1:]), pool.dtype, out_sharding=_staging_sharding(leaves[0])
    )

    def body(k, st):
        block = jax.lax.dynamic_slice_in_dim(pool, src_ids[k], 1, axis=0)  # [1, L, ...]
        block = jax.device_put(block, jax.memory.Space.Device)
        return jax.lax.dynamic_update_slice_in_dim(st, block, k, axis=0)

    staging = jax.lax.fori_loop(0, src_ids.shape[0], body, staging, unroll=UNROLL)
    return [
        x.at[dst_ids].set(staging[:, i], mode="drop", unique_indices=True)
        for i, x in enumerate(leaves)
    ]


@ft.partial(jax.jit, donate_argnames="leaves", static_argnames="plan")
def _swap_in_kernel(
    pool: jax.Array, leaves: list[jax.Array], ids: jaxsync.Packed, plan: _pallas.Plan
) -> list[jax.Array]:
    """`_swap_in` as one Pallas kernel per leaf that reads its blocks straight out of the pool:
    XLA hands the Triton call the pinned-host buffer itself (the optimized HLO passes the `S(5)`
    parameter to the custom call), so every block is read over PCIe at once, with no staging
    buffer and no scatter. Padded entries carry out-of-range destination ids and are skipped.
    Caches split over kv heads run it per shard (`plan.mesh`): each device reads its own slice
    of each pool block, with the replicated ids; nothing crosses devices."""

    def local(pool, leaves, src_ids, dst_ids):
        return [
            _pallas.copy_leaf(pool, x, src_ids, dst_ids, plan.backend, leaf=i)
            for i, x in enumerate(leaves)
        ]

    spec = plan.spec
    pool_spec = None if spec is None else PartitionSpec(spec[0], None, *spec[1:])  # _pool_sharding
    return _pallas.per_shard(local, plan, pool, leaves, ids, src_spec=pool_spec)


@entry_point
def swap_out(
    cache: Cache,
    pool: HostPool,
    src_ids: Any,
    dst_ids: Any,
    *,
    buckets: tuple[int, ...] | None = None,
) -> HostPool:
    """pool[dst_ids[k]] <- every layer's cache[src_ids[k]], one DMA per block.

    Args:
      cache: `{layer: [P, *block]}` (or (k, v) pairs) in device memory, one block shape/dtype.
      pool: a `HostPool` of the same structure; donated: use the returned pool.
      src_ids / dst_ids: host lists of cache and pool block ids, same length, dst unique.
      buckets: block-count buckets (default: powers of two >= 8).

    Raises:
      ValueError / TypeError: before anything is dispatched, on the checks `copy_blocks` makes
        and on a pool of another structure, block shape, dtype or memory kind.
    """
    leaves = _check(pool, cache)
    s, d = checked_ids(src_ids, dst_ids, leaves[0].shape[0], pool.num_blocks)
    if s.size == 0:
        return pool
    size = jaxsync.bucket(int(s.size), buckets)
    fields = {  # padding repeats the last pair: an idempotent rewrite
        "src": padded_ids(s, np.full(size, s[-1])),
        "dst": padded_ids(d, np.full(size, d[-1])),
    }
    ids = upload_ids(fields, leaves[0])
    return HostPool(_swap_out(committed(leaves), pool.blocks, ids), pool.treedef)


@entry_point
def swap_in(
    pool: HostPool,
    cache: Cache,
    src_ids: Any,
    dst_ids: Any,
    *,
    buckets: tuple[int, ...] | None = None,
    impl: Literal["auto", "xla"] = "auto",
) -> Cache:
    """cache[dst_ids[k]] <- pool[src_ids[k]] for every layer.

    Args:
      pool: a `HostPool` (not consumed).
      cache: `{layer: [P, *block]}` in device memory, of the pool's structure; donated: use the
        returned cache.
      src_ids / dst_ids: host lists of pool and cache block ids, same length, dst unique.
      buckets: block-count buckets (default: powers of two >= 8).
      impl: "auto" (default): on a GPU, for caches whose (per-device) block dims are powers of
        two, on one device or split over kv heads, one Pallas kernel per layer reading the
        blocks straight out of pinned host memory (every block in flight at once); elsewhere
        "xla": one DMA per block into a staging buffer, then one scatter per layer.

    Raises:
      ValueError / TypeError: before anything is dispatched, as `swap_out`, and on an `impl`
        that cannot run here.
    """
    if impl not in ("auto", "xla"):
        raise ValueError(f"impl must be 'auto' or 'xla', got {impl!r}")
    leaves = _check(pool, cache)
    kernel_plan = None if impl == "xla" else _pallas.auto_plan(leaves)
    num_dst = leaves[0].shape[0]
    s, d = checked_ids(src_ids, dst_ids, pool.num_blocks, num_dst)
    if s.size == 0:
        return cache
    size = jaxsync.bucket(int(s.size), buckets)
    sentinels = np.arange(num_dst, num_dst + size)  # dropped by the scatter
    fields = {"src": padded_ids(s, np.full(size, s[-1])), "dst": padded_ids(d, sentinels)}
    ids = upload_ids(fields, leaves[0])
    leaves = committed(leaves)
    if kernel_plan is None:
        out = _swap_in(pool.blocks, leaves, ids)
    else:
        with _pallas.quiet_triton_deprecation():  # Pallas warns whenever the kernel is lowered
            out = _swap_in_kernel(pool.blocks, leaves, ids, kernel_plan)
    return jax.tree_util.tree_unflatten(pool.treedef, out)
