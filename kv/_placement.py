"""Where a paged KV cache lives, checked on the host before every kv entry point's dispatch:
one memory kind ("device" or "pinned_host"), one set of devices, source and destination sharded
alike; and where a call's ids go (`upload_ids`) and how a cache is committed (`committed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

import jaxsync
from jaxsync import replicated_near


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
