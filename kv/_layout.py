"""Paged KV cache layouts and the host-side checks every kv entry point runs before dispatch.

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
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import jaxsync
from jaxsync import replicated_near
from jaxsync.kv._ids import host_int


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


def committed(tree: Any) -> Any:
    """`tree` with every uncommitted array committed to where it already is (no copy).

    jit keys its cache on whether an argument is committed, and an entry point returns committed
    arrays: without this, the second call of a bucket on a cache made by `jnp.zeros` (or any
    uncommitted array) would compile again. Committed arrays, the steady state, pass through."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if all(_traced(x) or x.committed for x in leaves):
        return tree
    placed = [x if _traced(x) or x.committed else jax.device_put(x, x.sharding) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, placed)


def _traced(leaf: jax.Array) -> bool:
    # Entry points also run under tracing (jaxsync.check's static scans); tracers have no
    # concrete sharding or deletion state, and their memory space lives on the abstract value.
    return isinstance(leaf, jax.core.Tracer)


def index_placement(leaf: jax.Array) -> jax.sharding.Sharding | None:
    """Where per-call ids go: device memory, replicated over the cache's devices."""
    return replicated_near(leaf)


def upload_ids(fields: dict[str, np.ndarray], leaf: jax.Array) -> jaxsync.Packed:
    """One packed upload of a call's host ids, placed for the cache `leaf` belongs to.

    Straight to device memory: staging the ids in pinned host memory instead (the program moving
    them) halves the upload's host time but makes the whole copy_blocks call slower on GPUs."""
    return jaxsync.upload_packed(fields, placement=index_placement(leaf))


def _memory_kind(leaf: jax.Array) -> str:
    if _traced(leaf):
        space = jax.typeof(leaf).memory_space
        return "pinned_host" if space == jax.memory.Space.Host else "device"
    return leaf.sharding.memory_kind or "device"


def memory_kind(leaves: Sequence[jax.Array], what: str) -> str:
    """The one memory kind all leaves of a cache live in ("device" or "pinned_host")."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        kinds = {_memory_kind(leaf) for leaf in leaves}
    else:  # concrete arrays, the hot path: one attribute read per leaf
        kinds = {leaf.sharding.memory_kind or "device" for leaf in leaves}
    if len(kinds) != 1:
        raise ValueError(f"{what} mixes memory kinds {sorted(kinds)}")
    (kind,) = kinds
    if kind not in ("device", "pinned_host"):
        raise ValueError(f"{what} lives in memory kind {kind!r}; supported: device, pinned_host")
    return kind


def _spread(leaf: jax.Array) -> bool:
    """A concrete leaf spread over several devices (traced leaves carry no concrete sharding)."""
    return not isinstance(leaf, jax.core.Tracer) and len(leaf.sharding.device_set) > 1


def same_sharding(a: jax.Array, b: jax.Array, b_sharding: Any = None) -> bool:
    """Whether leaf `a` is sharded like `b` (or like `b_sharding` for an array of a's rank),
    memory kinds aside."""
    sa = a.sharding
    sb = b.sharding if b_sharding is None else b_sharding
    if isinstance(sa, NamedSharding) and isinstance(sb, NamedSharding) and sa.mesh == sb.mesh:
        pa = tuple(sa.spec) + (None,) * (a.ndim - len(sa.spec))
        pb = tuple(sb.spec) + (None,) * (a.ndim - len(sb.spec))
        if pa == pb:  # the common case, without building HLO shardings
            return True
    return sa.with_memory_kind("device").is_equivalent_to(sb.with_memory_kind("device"), a.ndim)


def check_same_sharding(pairs: Iterable[tuple[jax.Array, jax.Array]], what: str) -> None:
    """Each (source, destination) leaf pair on several devices sharded alike. A block of one
    sharding written into an array of another either fails while tracing (a mesh with Explicit
    axes: after the ids were uploaded) or silently gives the destination the source's sharding
    (Auto axes). Raises ValueError."""
    for src, dst in pairs:
        if src is dst or not (_spread(src) or _spread(dst)):
            continue
        if not (_spread(src) and _spread(dst) and same_sharding(src, dst)):
            raise ValueError(
                f"{what} are sharded differently ({src.sharding} vs {dst.sharding}); a copy "
                f"keeps the destination's sharding only between caches placed alike"
            )


def check_placement(leaves: list[jax.Array], what: str) -> None:
    """All leaves on one set of devices: a program cannot read a cache on other devices than it
    writes (XLA would reject it at dispatch, after the upload). Raises ValueError."""
    shardings = {x.sharding for x in leaves if not isinstance(x, jax.core.Tracer)}
    sets = {frozenset(s.device_set) for s in shardings}
    if len(sets) > 1:
        named = sorted(sorted(str(d) for d in ds) for ds in sets)
        raise ValueError(f"{what} live on different devices: {named}")
