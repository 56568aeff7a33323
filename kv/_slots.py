"""Slot mappings and per-token KV gather/scatter (vLLM ExampleConnector's extract/inject).

A slot is `block_id * S + offset`: token t of a request lives at offset `slot % S` of block
`slot // S`. Attention leaves `[P, K, S, X]` give per-token rows `[T, K, X]` (heads kept, as
upstream's `layer[slot // S, :, slot % S]`); MLA leaves `[P, S, L]` give `[T, L]` (upstream's
`layer.reshape(P * S, -1)[slot]`).

The slot list is host data, validated on the host and uploaded once; it is padded to a bucket
with vLLM's padding slot -1, so every length in a bucket shares one program. A padded token (-1,
the caller's or the bucket's) writes nothing and reads zeros, as vLLM's `reshape_and_cache` and
its connectors skip it. On the device every slot outside [0, P*S) is padding: it is sent to a
distinct block past the end, so gathers fill it with zeros and scatters drop it, and the
scatter's promise of unique indices to XLA stays true.
"""

from __future__ import annotations

import functools as ft
from typing import Any

import jax
import jax.numpy as jnp

import jaxsync
from jaxsync.check import entry_point
from jaxsync.kv._geometry import planned_ids
from jaxsync.kv._layout import Cache
from jaxsync.kv._placement import check_placement, committed, upload_ids
from jaxsync.kv._quant import Scales, check_scales, dequantize_rows, quantize_rows
from jaxsync.kv._slot_plan import (
    check_id_array,
    check_ranks,
    check_row_placement,
    check_rows,
    check_slots,
    slot_geometry,
)


def _index(leaf: jax.Array, slots: jax.Array) -> tuple:
    """Where slots live in a leaf whose token axis S is second to last (`[P, K, S, X]`,
    `[P, S, L]`, stacked `[P, L, K, S, X]` / `[P, L, S, Lat]`): (block, ..., offset).
    Padding (any slot outside [0, P*S)) goes to distinct blocks P, P+1, ... past the end."""
    num_blocks, block_size = leaf.shape[0], leaf.shape[-2]
    real = (slots >= 0) & (slots < num_blocks * block_size)  # [N]
    spare = num_blocks + jnp.arange(slots.shape[0], dtype=jnp.int32)  # [N]
    block = jnp.where(real, (slots // block_size).astype(jnp.int32), spare)
    offset = jnp.where(real, (slots % block_size).astype(jnp.int32), 0)
    middle = (slice(None),) * (leaf.ndim - 3)  # kv heads and / or layers, kept whole
    return (block, *middle, offset)


def _slots_for(cache: Cache, slots: jax.Array | jaxsync.Packed, key: str, write: bool):
    """The slot ids to use on `cache`: a bare id array, or an uploaded plan's `key` checked
    against the geometry it was planned for (a read may use a write plan)."""
    leaves = jax.tree.leaves(cache)
    check_ranks(leaves)
    dims = slot_geometry(leaves[0], write)

    def read_of_write_plan(planned, dims):
        return not write and planned[:2] == dims[:2]

    slots = planned_ids(slots, key, dims, _GEOMETRY, accept=read_of_write_plan)
    check_id_array(slots, "slots")
    return slots


_GEOMETRY = ("blocks", "block size", "unique slots (write plan)")


def read_slots(
    cache: Cache,
    slots: jax.Array | jaxsync.Packed,
    *,
    key: str = "slots",
    scales: Scales | None = None,
    dtype: Any = jnp.float32,
) -> Cache:
    """Gathers the rows of `slots` from every layer: pure and traceable, for a server's own jit.

    Args:
      cache: `{layer: [P, K, S, X] | [P, S, L] | (k, v)}` or a `StackedCache` (`[P, L, ...]`).
      slots: the uploaded plan (`jaxsync.upload_packed` of `plan_slots` fields: its field
        `key` is read, after checking that it was planned for this cache's geometry), or an
        int `[N]` id array on the device (used as given). Padding (-1, any slot outside
        [0, P*S)) reads as zeros.
      key: the plan's field of slot ids.
      scales: for an fp8 cache, its `KVScales` (one for all layers, or `{layer: KVScales}`):
        the rows come back dequantized to `dtype` (`float32(q) * scale`, as vLLM reads them).
        Without, the rows keep the cache's dtype.
      dtype: the compute dtype of dequantized rows.

    Returns:
      The cache's structure with leaves `[N, K, X]` / `[N, L]` (stacked: `[N, L, K, X]`); what
      `extract_kv` returns for the same slots.

    Raises:
      PlanGeometryError: while tracing, for a plan made for a cache of another block count or
        block size.
      TypeError, ValueError: while tracing, scales that do not fit the cache (see `KVScales`).
    """
    slots = _slots_for(cache, slots, key, write=False)
    if scales is not None:
        check_scales(cache, scales)
        return dequantize_rows(cache, read_slots(cache, slots), scales, dtype)

    def one(leaf):  # -> row_shape(leaf.shape, N)
        return leaf.at[_index(leaf, slots)].get(mode="fill", fill_value=0)

    return jax.tree.map(one, cache)


def write_slots(
    cache: Cache,
    rows: Cache,
    slots: jax.Array | jaxsync.Packed,
    *,
    key: str = "slots",
    scales: Scales | None = None,
) -> Cache:
    """Writes per-token rows into every layer at `slots` (vLLM's `reshape_and_cache`): pure and
    traceable, for a server's own jit; donate the cache there (it is updated in place).

    Args:
      cache: as for `read_slots`.
      rows: the cache's structure, leaves `[N, K, X]` / `[N, L]` (stacked: `[N, L, K, X]`) of
        the cache's dtype (with `scales`: of any float dtype), N = the number of slots; rows
        at padding slots are dropped.
      slots: the uploaded plan of `plan_slots(..., write=True)` (checked against this cache),
        or an int `[N]` id array on the device, unique apart from padding (-1, or any slot
        outside [0, P*S): nothing is written there).
      key: the plan's field of slot ids.
      scales: for an fp8 cache, its `KVScales`: rows are quantized as vLLM writes them
        (float32 `row / scale`, saturated to the fp8 range, cast to nearest even).

    Returns:
      The updated cache; what `inject_kv` returns for the same rows and slots.

    Raises:
      ValueError: while tracing, when the rows' structure, shapes or dtypes do not match, or a
        cache leaf has no token axis where slots look for it (a rank other than 3 to 5).
      PlanGeometryError: while tracing, for a plan made for another cache geometry, or a read
        plan (`write=False`: slots not checked unique).
    """
    slots = _slots_for(cache, slots, key, write=True)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    check_rows(leaves, treedef, rows, slots.shape[0], quantized=scales is not None)
    if scales is not None:
        check_scales(cache, scales)
        rows = quantize_rows(cache, rows, scales)

    def one(leaf, r):
        return leaf.at[_index(leaf, slots)].set(r, mode="drop", unique_indices=True)

    return jax.tree.map(one, cache, rows)


def concat_and_cache_mla(
    cache: Cache,
    kv_c: Cache,
    k_pe: Cache,
    slots: jax.Array | jaxsync.Packed,
    *,
    key: str = "slots",
    scales: Scales | None = None,
) -> Cache:
    """vLLM's `concat_and_cache_mla`: each token's latent `kv_c` and rope part `k_pe` written as
    one MLA cache row `concat(kv_c, k_pe)` (quantized with the one scale of an fp8 cache).
    Pure and traceable, as `write_slots`.

    Args:
      cache: MLA `{layer: [P, S, Lc + R]}` or a stacked MLA cache.
      kv_c: the cache's structure, leaves `[N, Lc]` (stacked `[N, L, Lc]`).
      k_pe: the same, leaves `[N, R]`.
      slots, key, scales: as for `write_slots` (`KVScales(k)` for an fp8 cache).
    """
    rows = jax.tree.map(lambda c, pe: jnp.concatenate([c, pe], axis=-1), kv_c, k_pe)
    return write_slots(cache, rows, slots, key=key, scales=scales)


@ft.partial(jax.jit, static_argnames="dtype")
def _extract(caches: Cache, ids: jaxsync.Packed, scales: Scales | None = None, dtype=None) -> Cache:
    return read_slots(caches, ids["slots"], scales=scales, dtype=dtype)


@ft.partial(jax.jit, donate_argnames="caches")
def _inject(caches: Cache, kv: Cache, ids: jaxsync.Packed, scales: Scales | None = None) -> Cache:
    return write_slots(caches, kv, ids["slots"], scales=scales)


@entry_point
def extract_kv(
    caches: Cache,
    slot_mapping: Any,
    *,
    buckets: tuple[int, ...] | None = None,
    scales: Scales | None = None,
    dtype: Any = jnp.float32,
) -> Cache:
    """Gathers the KV rows of `slot_mapping` from every layer in one jitted call.

    Args:
      caches: `{layer: [P, K, S, X] | [P, S, L] | (k, v)}` in device memory.
      slot_mapping: host list/ndarray of T slots in [0, P*S), or -1 for a padded token.
      buckets: length buckets (default: powers of two >= 8).
      scales, dtype: for an fp8 cache, rows dequantized to `dtype` (see `read_slots`).

    Returns:
      `{layer: [N, K, X] | [N, L]}` with N = bucket(T) >= T: rows of padded tokens and rows
      T.. are zeros (the padded length keeps one program per bucket; slice `[:T]` on the host
      after reading back).
    """
    leaves, _, _, fields = check_slots(caches, slot_mapping, buckets, unique=False)
    if scales is not None:
        check_scales(caches, scales)
        dtype = jnp.dtype(dtype)  # a hashable static argument
    ids = upload_ids(fields, leaves[0])
    return _extract(committed(caches), ids, scales, None if scales is None else dtype)


@entry_point
def inject_kv(
    caches: Cache,
    kv: Cache,
    slot_mapping: Any,
    *,
    buckets: tuple[int, ...] | None = None,
    scales: Scales | None = None,
) -> Cache:
    """Writes per-token KV rows into every layer at `slot_mapping`, in one jitted call.

    Args:
      caches: as for `extract_kv`; donated (use the returned cache).
      kv: same structure, leaves `[N, K, X]` / `[N, L]` with N = bucket(T) (what `extract_kv`
        returns); rows T.. are ignored.
      slot_mapping: host list/ndarray of T slots in [0, P*S), unique, or -1 for a padded
        token (its row is not written).
      buckets: length buckets (default: powers of two >= 8).
      scales: for an fp8 cache, rows of any float dtype quantized in (see `write_slots`).

    Returns:
      The updated caches. With T = 0, `caches` itself (nothing dispatched).

    Raises:
      ValueError: before dispatch on bad slots or kv rows whose structure, shape or dtype do not
        match the caches, or rows sharded neither as `row_sharding` cuts them from the cache
        nor replicated.
    """
    leaves, n, size, fields = check_slots(caches, slot_mapping, buckets, unique=True)
    treedef = jax.tree_util.tree_structure(caches)
    kv_leaves = check_rows(leaves, treedef, kv, size, n, quantized=scales is not None)
    if scales is not None:
        check_scales(caches, scales)
    check_placement(leaves + kv_leaves, "caches and kv rows")
    check_row_placement(leaves, kv_leaves)
    if n == 0:
        return caches
    ids = upload_ids(fields, leaves[0])
    return _inject(committed(caches), committed(kv), ids, scales)
