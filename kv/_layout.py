"""Paged KV cache layouts and the host-side checks of a cache's structure every kv entry point
runs before dispatch (where a cache lives is checked in `_placement`).

A cache is a pytree `{layer_name: leaf_or_pair}` whose leaves all put the block dimension first:

* packed attention (vLLM): `[P, K, S, 2H]`, K and V concatenated on the last axis;
* separate K/V: a `(k, v)` pair of `[P, K, S, H]` arrays;
* MLA: `[P, S, L]`, L = kv_lora_rank + rope dim.

(P = blocks, K = kv heads, S = block size, H = head dim, L = latent dim.) A `StackedCache`
holds every layer in one block-major array (or (k, v) pair), `[P, layers, ...]`. Block copies are
layout-agnostic (dim 0 only); slot-mapping gathers find the token axis S second to last.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync.kv._ids import host_int
from jaxsync.kv._placement import committed


@ft.partial(jax.tree_util.register_dataclass, data_fields=["kv"], meta_fields=["layers"])
@dataclasses.dataclass(frozen=True)
class StackedCache:
    """Every layer of a paged KV cache in one array (or one (k, v) pair), block-major.

    Attributes:
      kv: `[P, L, ...]`: block b of every layer at `kv[b]` (`[P, L, K, S, 2H]` packed,
        `[P, L, S, Lat]` MLA), or a `(k, v)` pair of `[P, L, K, S, H]`.
      layers: the L layer names, in the order of axis 1 (the names `save_kv` writes).

    Why block-major: a block copy, swap or inject over all layers is then one gather / scatter
    on one array, so every entry point runs ONE program whose argument count does not grow with
    L, and a block of all layers is contiguous (one DMA per block to or from pinned host).
    Attention reads layer l as the strided view `kv[:, l]`.
    """

    kv: Any
    layers: tuple[str, ...]


Cache = dict[str, Any] | StackedCache  # layer name -> [P, ...] array or (k, v) pair; or stacked


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Shape of one layer's paged KV cache.

    Attributes:
      kind: "packed" ([P, K, S, 2H]), "separate" ((k, v) pair of [P, K, S, H]) or "mla"
        ([P, S, L]).
      num_blocks: P, physical (kernel) blocks.
      block_size: S, tokens per block.
      num_kv_heads: K (attention layouts only).
      head_dim: H (attention layouts only).
      latent_dim: L (MLA only).
      dtype: element dtype.
      stacked: caches made by `random` are `StackedCache`s (all layers in one block-major
        array per K/V) instead of `{layer: array}` dicts.
    """

    kind: Literal["packed", "separate", "mla"]
    num_blocks: int
    block_size: int
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    dtype: Any = jnp.bfloat16
    stacked: bool = False

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim", "latent_dim"):
            # Sizes are ints: a bool (True) would silently be a size of 1, a float a late error.
            object.__setattr__(self, name, host_int(getattr(self, name), name))
        if self.kind not in ("packed", "separate", "mla"):
            raise ValueError(f"kind must be 'packed', 'separate' or 'mla', got {self.kind!r}")
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if self.kind == "mla" and self.latent_dim <= 0:
            raise ValueError("an MLA layout needs latent_dim > 0")
        if self.kind != "mla" and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise ValueError(f"a {self.kind} layout needs num_kv_heads > 0 and head_dim > 0")

    @property
    def leaf_shape(self) -> tuple[int, ...]:
        """Shape of one array of the layer (each of k and v for "separate")."""
        if self.kind == "mla":
            return (self.num_blocks, self.block_size, self.latent_dim)
        last = 2 * self.head_dim if self.kind == "packed" else self.head_dim
        return (self.num_blocks, self.num_kv_heads, self.block_size, last)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer (k and v together)."""
        leaves = 2 if self.kind == "separate" else 1
        return leaves * int(np.prod(self.leaf_shape[1:])) * jnp.dtype(self.dtype).itemsize

    def random(self, layers: Sequence[str], key: jax.Array, *, placement=None) -> Cache:
        """A cache of random values (tests, benchmarks), placed with `placement` if given."""
        keys = jax.random.split(key, 2 * len(layers))
        dt = jnp.dtype(self.dtype)

        def leaf(k):
            if jnp.issubdtype(dt, jnp.integer):
                info = jnp.iinfo(dt)
                x = jax.random.randint(k, self.leaf_shape, info.min, info.max, dtype=dt)
            else:
                x = jax.random.normal(k, self.leaf_shape, jnp.float32).astype(dt)
            # Committed either way: a cache's placement then stays the same across calls (an
            # entry point's result is committed), so one bucket compiles once.
            return jax.device_put(x, x.sharding if placement is None else placement)

        if self.stacked:  # the same values as the per-layer cache of this key, stacked
            per_layer = dataclasses.replace(self, stacked=False)
            return stack_layers(per_layer.random(layers, key, placement=placement))
        cache = {}
        for i, name in enumerate(layers):
            if self.kind == "separate":
                cache[name] = (leaf(keys[2 * i]), leaf(keys[2 * i + 1]))
            else:
                cache[name] = leaf(keys[2 * i])
        return cache


@jax.jit
def _stack(leaves: list) -> jax.Array:
    return jnp.stack(leaves, axis=1)


def stack_layers(cache: dict[str, Any]) -> StackedCache:
    """A per-layer cache as a `StackedCache` (a copy; setup, not hot path), layers in the
    dict's order, each layer's sharding kept on its axes (the layer axis unsharded)."""
    layers = tuple(cache)
    first = cache[layers[0]]
    if isinstance(first, tuple | list):
        kv = tuple(committed(_stack([cache[n][i] for n in layers])) for i in range(2))
    else:
        kv = committed(_stack([cache[n] for n in layers]))
    return StackedCache(kv, layers)


_take_layer = jax.jit(lambda x, i: x[:, i], static_argnums=1)


def unstack_layers(cache: StackedCache) -> dict[str, Any]:
    """A `StackedCache` as `{layer: [P, ...]}` (copies; setup and tests)."""
    take = _take_layer
    out = {}
    for i, name in enumerate(cache.layers):
        out[name] = (
            take(cache.kv, i)
            if isinstance(cache.kv, jax.Array)
            else tuple(take(x, i) for x in cache.kv)
        )
    return out


def cache_leaves(cache: Cache, what: str) -> tuple[list[jax.Array], Any]:
    """Flattens a cache, checking that it is a non-empty dict (or `StackedCache`) of
    block-first jax.Arrays."""
    if isinstance(cache, StackedCache):
        if not isinstance(cache.kv, jax.Array | tuple):
            raise TypeError(f"{what}.kv must be an array or a (k, v) pair")
        for leaf in jax.tree.leaves(cache.kv):
            if getattr(leaf, "ndim", 0) < 3 or leaf.shape[1] != len(cache.layers):
                shape = getattr(leaf, "shape", None)
                raise ValueError(
                    f"{what}: stacked leaves are [P, {len(cache.layers)}, ...], got {shape}"
                )
    elif not isinstance(cache, dict):
        raise TypeError(f"{what} must be a dict layer_name -> array, got {type(cache).__name__}")
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    if not leaves:
        raise ValueError(f"{what} holds no arrays")
    blocks = set()
    for leaf in leaves:  # one pass, each property read once: this runs on every hot-path call
        if not isinstance(leaf, jax.Array):
            raise TypeError(f"{what} leaves must be jax.Arrays, got {type(leaf).__name__}")
        shape = leaf.shape
        if len(shape) < 2:
            raise ValueError(f"{what} leaves need a block dim and a block, got shape {shape}")
        if not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
            raise ValueError(f"{what} holds a deleted (donated) array; use the returned cache")
        blocks.add(shape[0])
    if len(blocks) != 1:
        raise ValueError(f"{what} layers disagree on the number of blocks: {sorted(blocks)}")
    return leaves, treedef


def check_same_structure(
    src: Cache, dst: Cache, src_name: str, dst_name: str, *, flat: tuple | None = None
) -> None:
    """Same layer set, same per-layer structure, same block shape and dtype (P may differ).

    `flat`: `(src_leaves, src_treedef, dst_leaves, dst_treedef)` when the caller has them
    (`cache_leaves`), so the hot path flattens each cache once."""
    if flat is None:
        flat = (*jax.tree_util.tree_flatten(src), *jax.tree_util.tree_flatten(dst))
    s_leaves, s_def, d_leaves, d_def = flat
    if (
        s_def == d_def
        and all(  # the common case, in one pass; the loop below names the culprit
            s.shape[1:] == d.shape[1:] and s.dtype == d.dtype
            for s, d in zip(s_leaves, d_leaves, strict=True)
        )
    ):
        return
    if isinstance(src, StackedCache) != isinstance(dst, StackedCache):
        raise ValueError(f"{src_name} and {dst_name}: one is a StackedCache, the other is not")
    if isinstance(src, StackedCache):
        if src.layers != dst.layers:
            raise ValueError(f"{src_name} and {dst_name} stack different layers")
        src, dst = {"stacked": src.kv}, {"stacked": dst.kv}
    if set(src) != set(dst):
        only_s, only_d = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
        raise ValueError(
            f"{src_name} and {dst_name} have different layers: only in {src_name}: {only_s}, "
            f"only in {dst_name}: {only_d}"
        )
    for name in src:
        s_leaves, s_def = jax.tree_util.tree_flatten(src[name])
        d_leaves, d_def = jax.tree_util.tree_flatten(dst[name])
        if s_def != d_def:
            raise ValueError(
                f"layer {name!r}: structure {s_def} in {src_name}, {d_def} in {dst_name}"
            )
        for s, d in zip(s_leaves, d_leaves, strict=True):
            if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
                raise ValueError(
                    f"layer {name!r}: block shape/dtype {s.shape[1:]} {s.dtype} in {src_name} but "
                    f"{d.shape[1:]} {d.dtype} in {dst_name}"
                )
