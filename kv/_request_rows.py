"""A request's rows between a cache and its files: per-layer views of a cache (a stacked cache's
layer l is `kv[:, l]`), the plan and writes of a save across processes (the blocks of rows this
process owns, one file each), and the uploads of a load (rows padded to the slot bucket, each
leaf's on its row sharding, whole or block by block).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

import jaxsync
from jaxsync.kv._file_format import Format, to_tensors
from jaxsync.kv._layout import Cache, StackedCache
from jaxsync.kv._shards import (
    block_leaves,
    index_key,
    row_blocks,
    row_shape,
    shard_name,
    write_shard,
)
from jaxsync.kv._slot_plan import row_sharding
from jaxsync.kv._slots import extract_kv


def layer_leaves(caches: Cache) -> dict[str, list]:
    """`{layer: [leaf-like per tensor]}` as files store them; a stacked cache's layer l is
    `kv[:, l]` (only shape, dtype and placement are read: no slicing happens here)."""
    if not isinstance(caches, StackedCache):
        return {n: [v] if isinstance(v, jax.Array) else list(v) for n, v in caches.items()}
    leaves = [caches.kv] if isinstance(caches.kv, jax.Array) else list(caches.kv)
    per_layer = [jax.ShapeDtypeStruct((x.shape[0], *x.shape[2:]), x.dtype) for x in leaves]
    return dict.fromkeys(caches.layers, per_layer)


def per_layer_rows(rows: Any, caches: Cache) -> dict[str, list[np.ndarray]]:
    """Host rows of `extract_kv` by layer (a stacked cache's `[N, L, ...]` split on axis 1)."""
    if not isinstance(caches, StackedCache):
        return {n: [v] if isinstance(v, np.ndarray) else list(v) for n, v in rows.items()}
    leaves = [rows.kv] if isinstance(rows.kv, np.ndarray) else list(rows.kv)
    return {n: [x[:, i] for x in leaves] for i, n in enumerate(caches.layers)}


def row_arrays(tree: Any, caches: Cache) -> dict[str, tuple[list, int | None]]:
    """`{layer: ([array per leaf], row of the layer axis or None)}` of a cache-shaped tree (the
    cache's leaves, or `extract_kv`'s rows): a stacked tree's layers share its leaves."""
    if not isinstance(caches, StackedCache):
        return {n: ([v] if isinstance(v, jax.Array) else list(v), None) for n, v in tree.items()}
    leaves = [tree.kv] if isinstance(tree.kv, jax.Array) else list(tree.kv)
    return {n: (leaves, i) for i, n in enumerate(caches.layers)}


def rows_shape(leaf: jax.Array, size: int, stacked: bool) -> tuple:
    """The shape of `size` rows cut from a cache leaf (`[N, (L,) *row axes]`)."""
    per_layer = (leaf.shape[0], *leaf.shape[2:]) if stacked else leaf.shape
    layer_axis = (leaf.shape[1],) if stacked else ()
    return (size, *layer_axis, *row_shape(jax.ShapeDtypeStruct(per_layer, leaf.dtype)))


def shard_plan(caches: Cache, size: int) -> dict[str, dict]:
    """`{layer: {ranges: (index key, owner process)}}`: the blocks of each layer's rows (as
    `row_sharding` cuts them from the cache), the same for a layer's k and v (ValueError else)."""
    stacked = isinstance(caches, StackedCache)
    plan = {}
    for layer, (leaves, pos) in row_arrays(caches, caches).items():
        blocks = [row_blocks(rows_shape(x, size, stacked), row_sharding(x), pos) for x in leaves]
        if any(set(b) != set(blocks[0]) for b in blocks):
            raise ValueError(f"layer {layer!r}: k and v are sharded differently; cannot save")
        plan[layer] = blocks[0]
    return plan


def save_shards(folder: str, caches: Cache, slots: np.ndarray, plan: dict, format: Format):
    """Writes the blocks this process owns (see `_shards`), from its own devices' rows only."""
    rows = extract_kv(caches, slots)
    me, n = jax.process_index(), int(slots.size)
    layers = layer_leaves(caches)
    wanted, fetch = [], []
    for layer, (arrays, pos) in row_arrays(rows, caches).items():
        for ranges, (key, owner) in plan[layer].items():
            if owner != me:
                continue
            for x in arrays:
                shards = {index_key(sh.index, x.shape): sh for sh in x.addressable_shards}
                fetch.append(shards[key].data)
            wanted.append((layer, ranges, pos, key, len(arrays)))
    host = iter(jax.device_get(fetch))  # explicit: this process's own blocks, one readback
    for layer, ranges, pos, key, count in wanted:
        kept = [next(host)[:n] for _ in range(count)]
        if pos is not None:
            kept = [a[:, pos - key[1][0]] for a in kept]
        leaves = block_leaves(layers[layer], ranges)
        whole = row_shape(layers[layer][0])
        path = os.path.join(folder, shard_name(layer, ranges))
        write_shard(path, to_tensors(kept, leaves, format), layer, ranges, whole, format)


def upload_blocks(caches, host, shards, n: int, size: int) -> Cache:
    """Rows uploaded block by block, each leaf on its row sharding: every block this process's
    devices hold is built on the host (from a layer's whole file, or from the shard files that
    intersect it) before any is uploaded, so a missing or bad file leaves the caches untouched."""
    stacked = isinstance(caches, StackedCache)
    blocks: dict[tuple, np.ndarray] = {}
    shard_rows: dict[tuple, list[np.ndarray]] = {}

    def layer_rows(layer: str, leaf: int, ranges: tuple) -> np.ndarray:
        if layer in host:
            return host[layer][leaf][(slice(None), *(slice(a, b) for a, b in ranges))]
        if (layer, ranges) not in shard_rows:
            shard_rows[layer, ranges] = shards[layer].rows(ranges)
        return shard_rows[layer, ranges][leaf]

    names = list(caches.layers) if stacked else None
    arrays = row_arrays(caches, caches)
    targets = []  # (layer or None, leaf number, cache leaf)
    if stacked:
        targets = [(None, i, x) for i, x in enumerate(next(iter(arrays.values()))[0])]
    else:
        targets = [(lay, i, x) for lay, (xs, _) in arrays.items() for i, x in enumerate(xs)]
    puts = []
    for layer, i, x in targets:
        shape, sharding = rows_shape(x, size, stacked), row_sharding(x)
        for index in sharding.addressable_devices_indices_map(shape).values():
            key = index_key(index, shape)
            if (id(x), key) in blocks:
                continue
            if stacked:
                (a, b), rest = key[1], key[2:]
                part = np.stack([layer_rows(names[j], i, rest) for j in range(a, b)], axis=1)
            else:
                part = layer_rows(layer, i, key[1:])
            padded = np.zeros((size, *part.shape[1:]), part.dtype)
            padded[:n] = part
            blocks[id(x), key] = padded
        puts.append((layer, i, x, shape, sharding))

    def put(x, shape, sharding):
        def block(index):
            return blocks[id(x), index_key(index, shape)]

        return jax.make_array_from_callback(shape, sharding, block)

    if stacked:
        out = [put(x, shape, sharding) for _, _, x, shape, sharding in puts]
        return StackedCache(
            out[0] if isinstance(caches.kv, jax.Array) else tuple(out), caches.layers
        )
    kv: dict[str, Any] = {}
    for layer, value in caches.items():
        got = [put(x, shape, sharding) for lay, _, x, shape, sharding in puts if lay == layer]
        kv[layer] = got[0] if isinstance(value, jax.Array) else type(value)(got)
    return kv


def upload_rows(caches: Cache, host: dict[str, list[np.ndarray]], n: int, size: int) -> Cache:
    """The checked rows padded to the bucket in fresh host buffers (nobody mutates them after,
    so the async put may alias them) and uploaded, one put per cache leaf, each on its leaf's
    row sharding; a stacked cache's layers are stacked on the host first."""

    def put(rows: np.ndarray, leaf: jax.Array) -> jax.Array:
        padded = np.zeros((size, *rows.shape[1:]), rows.dtype)
        padded[:n] = rows
        return jaxsync.async_h2d(padded, placement=row_sharding(leaf), copy=False)

    if isinstance(caches, StackedCache):
        leaves = [caches.kv] if isinstance(caches.kv, jax.Array) else list(caches.kv)
        stacked = [
            np.stack([host[n][i] for n in caches.layers], axis=1) for i in range(len(leaves))
        ]
        puts = [put(rows, x) for rows, x in zip(stacked, leaves, strict=True)]
        return StackedCache(puts[0] if len(puts) == 1 else tuple(puts), caches.layers)
    kv = {}
    for layer, value in caches.items():
        leaves = [value] if isinstance(value, jax.Array) else list(value)
        puts = [put(rows, x) for rows, x in zip(host[layer], leaves, strict=True)]
        kv[layer] = puts[0] if isinstance(value, jax.Array) else type(value)(puts)
    return kv
