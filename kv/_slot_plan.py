"""The host side of slot gathers: slot mappings, the checks of caches, slots and rows, and
`plan_slots` (the padded upload field of a server step's `write_slots` / `read_slots`).

A slot is `block_id * S + offset` (see `jaxsync.kv._slots`). The slot list is host data: it is
validated here, on the host, and padded to a bucket with vLLM's padding slot -1, so every length
in a bucket shares one program. A -1 in the caller's own mapping is a padded token as in vLLM:
it writes nothing and reads zeros; any other negative slot, or one past the cache, is refused.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync.kv._geometry import geometry_field
from jaxsync.kv._ids import PAD, check_range, check_unique, host_ids, host_int, padded_ids
from jaxsync.kv._layout import Cache, cache_leaves
from jaxsync.kv._placement import memory_kind, same_sharding


def slot_mapping_for(block_ids: Any, block_size: int, num_tokens: int) -> np.ndarray:
    """Slots of the first tokens of a request, rounded down to whole blocks as upstream does.

    Upstream (`ReqMeta.make_meta`) keeps `(n - 1) // S * S` tokens: the last token is always
    dropped, so a prompt of exactly k*S tokens keeps only k-1 blocks, and n = 0 gives -S, which
    upstream then uses as a negative slice end (all but the last block of the table: garbage).
    Here n = 0 gives an empty mapping, and a block table too short for the kept tokens raises
    (upstream silently returns fewer slots than tokens). A block id of -1 (a padded entry of
    the block table) gives -1 slots, padded tokens: nothing is saved or loaded there.

    Args:
      block_ids: host list of the request's block ids, in token order; -1 for padding.
      block_size: S, tokens per block (the kernel block size).
      num_tokens: n, the request's token count.

    Returns:
      int64 `[(n - 1) // S * S]` slots (a multiple of S; empty when n <= S).

    >>> slot_mapping_for([3, 1], 4, 6).tolist()
    [12, 13, 14, 15]
    >>> slot_mapping_for([3, 1], 4, 8).tolist(), slot_mapping_for([3], 4, 0).tolist()
    ([12, 13, 14, 15], [])
    """
    block_size = host_int(block_size, "block_size")
    num_tokens = host_int(num_tokens, "num_tokens")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    ids = host_ids(block_ids, "block_ids")
    check_range(ids, np.iinfo(np.int32).max // block_size, "block_ids", padding=True)
    valid = 0 if num_tokens == 0 else (num_tokens - 1) // block_size * block_size
    needed = valid // block_size
    if ids.size < needed:
        raise ValueError(f"{num_tokens} tokens keep {needed} blocks but only {ids.size} are given")
    offsets = np.arange(block_size, dtype=np.int64)
    slots = ids[:needed, None] * block_size + offsets[None, :]  # [needed, S]
    return np.where(ids[:needed, None] == PAD, PAD, slots).reshape(-1)


def row_shape(leaf_shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    """Per-token rows cut from a leaf: `[T, K, X]`, `[T, L]` or stacked `[T, L, K, X]`."""
    return (rows, *leaf_shape[1:-2], leaf_shape[-1])


def check_ranks(leaves: list) -> None:
    """Leaves slots can address: the token axis S second to last of `[P, K, S, X]`, `[P, S, L]`
    or their stacked forms. Another rank would put S elsewhere and address the wrong rows."""
    for leaf in leaves:
        if leaf.ndim not in (3, 4, 5):
            raise ValueError(
                f"slot gathers need [P, K, S, X] (attention) or [P, S, L] (MLA) leaves (with a "
                f"layer axis after P if stacked), got shape {leaf.shape}"
            )


def check_id_array(ids: jax.Array, name: str) -> None:
    """Slot or block ids inside a jit: a 1-D integer array (checked while tracing, from its
    static type; the values are device data, never read)."""
    if not isinstance(ids, jax.Array) or not jnp.issubdtype(ids.dtype, jnp.integer):
        what = getattr(ids, "dtype", type(ids).__name__)
        raise TypeError(f"{name} must be an integer jax.Array (uploaded by the plan), got {what}")
    if ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {ids.shape}")


def check_rows(
    leaves: list, treedef: Any, kv: Cache, size: int, n: int | None = None, quantized=False
) -> list:
    """Per-token rows `kv` fit the cache (`leaves`, `treedef`) at a bucket of `size` slots, `n`
    of them real: same structure, `row_shape` shapes, same dtypes (`quantized`: any float
    dtype, quantized on the way in). Returns kv's leaves."""
    kv_leaves, kv_def = jax.tree_util.tree_flatten(kv)
    if kv_def != treedef:
        raise ValueError(f"kv structure {kv_def} does not match the caches' {treedef}")
    for leaf, rows in zip(leaves, kv_leaves, strict=True):
        if not isinstance(rows, jax.Array):
            raise TypeError("kv rows must be jax.Arrays (load_kv uploads host data)")
        if not isinstance(rows, jax.core.Tracer) and rows.is_deleted():
            raise ValueError("kv holds a deleted (donated) array")
        want = row_shape(leaf.shape, size)
        fits = jnp.issubdtype(rows.dtype, jnp.floating) if quantized else rows.dtype == leaf.dtype
        if tuple(rows.shape) != want or not fits:
            count = f"{size} slots" if n is None else f"{n} slots (bucket {size})"
            dtype = "of a float dtype" if quantized else str(leaf.dtype)
            raise ValueError(
                f"kv rows must be {want} {dtype} for {count}, got {tuple(rows.shape)} {rows.dtype}"
            )
    return kv_leaves


def check_slots(caches: Cache, slot_mapping: Any, buckets, *, unique: bool, name="slot_mapping"):
    """Validates caches and slots on the host; returns (leaves, n, bucket, padded upload
    fields). `name`: what the slots are called in errors."""
    leaves, _ = cache_leaves(caches, "caches")
    check_ranks(leaves)
    for leaf in leaves:
        if memory_kind([leaf], "caches") != "device":
            raise ValueError("extract_kv / inject_kv work on device-memory caches")
    sizes = {leaf.shape[-2] for leaf in leaves}
    if len(sizes) != 1:
        raise ValueError(f"layers disagree on the block size: {sorted(sizes)}")
    (block_size,) = sizes
    num_slots = leaves[0].shape[0] * block_size
    slots = host_ids(slot_mapping, name)
    check_range(slots, num_slots, name, padding=True)
    if unique:
        check_unique(slots, name)
    n = int(slots.size)
    size = jaxsync.bucket(n, buckets)
    if leaves[0].shape[0] + size > np.iinfo(np.int32).max or num_slots > np.iinfo(np.int32).max:
        raise ValueError("cache too large for int32 slot ids")
    return leaves, n, size, {"slots": padded_ids(slots, np.full(size, PAD))}


def plan_slots(
    cache: Cache,
    slot_mapping: Any,
    *,
    write: bool = True,
    buckets: tuple[int, ...] | None = None,
    key: str = "slots",
) -> dict[str, np.ndarray]:
    """The host plan of a server step's `write_slots` (or `read_slots`: `write=False`).

    Validates what `inject_kv` (`extract_kv`) validates, on the host, and pads the slots to a
    bucket with -1 (padding: no-ops), so every length in a bucket shares one program. Put the
    fields in the step's one `jaxsync.upload_packed` and pass the uploaded plan to
    `write_slots` / `read_slots`: they check, while tracing, that it was planned for the cache
    they are given (`PlanGeometryError` otherwise).

    Args:
      cache: the cache the step will write (host metadata only: shapes, memory kind).
      slot_mapping: host list/ndarray of T slots in [0, P*S), or -1 for a padded token (writes
        nothing, reads zeros); unique when `write` (padding aside).
      write: check that the slots are unique (scatter targets).
      buckets: length buckets (default: powers of two >= 8).
      key: the ids' field name.

    Returns:
      `{key: int32 [N], key + ".geometry": int32 [0, P, S, write]}`, N = bucket(T); the second
      field records the cache geometry in its shape (no bytes uploaded).

    Raises:
      TypeError, ValueError: as `inject_kv` / `extract_kv`, before anything is uploaded.
    """
    leaves, _, _, fields = check_slots(cache, slot_mapping, buckets, unique=write)
    return {key: fields["slots"], **geometry_field(key, slot_geometry(leaves[0], write))}


def slot_geometry(leaf: jax.Array, write: bool) -> tuple[int, int, int]:
    """What a slot plan depends on: the cache's blocks P and block size S, and whether its
    slots were checked unique (a write's scatter promises XLA unique indices)."""
    return (leaf.shape[0], leaf.shape[-2], int(write))


def row_sharding(leaf: jax.Array) -> jax.sharding.Sharding | None:
    """Sharding of per-token rows cut from `leaf`: its head/latent sharding, rows replicated."""
    if isinstance(leaf, jax.core.Tracer):
        return None  # traced by a static scan: placement is irrelevant there
    sharding = leaf.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    kept = (None, *spec[1:-2], spec[-1])  # as row_shape: blocks and offsets become tokens
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*kept))


def check_row_placement(leaves: list, kv_leaves: list) -> None:
    """Rows for a cache spread over devices are sharded as `row_sharding` cuts them from it, or
    replicated. Rows sharded otherwise fail while tracing (Explicit mesh axes) or silently hand
    the updated cache their own sharding (Auto axes). Raises ValueError."""
    for leaf, rows in zip(leaves, kv_leaves, strict=True):
        if isinstance(rows, jax.core.Tracer) or isinstance(leaf, jax.core.Tracer):
            continue
        sharding = rows.sharding
        if len(leaf.sharding.device_set) == 1 or sharding.is_fully_replicated:
            continue
        if not same_sharding(rows, rows, row_sharding(leaf)):
            raise ValueError(
                f"kv rows sharded {sharding} do not fit a cache leaf sharded {leaf.sharding}: "
                f"place them with row_sharding(leaf), or replicated"
            )
