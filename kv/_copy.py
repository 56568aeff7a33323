"""`copy_blocks`: dst[layer][dst_ids[k]] <- src[layer][src_ids[k]] for every layer, in one program.

Port of vLLM's `copy_kv_blocks` (kv_connector/utils.py) with these changes, all deliberate:

* mismatched id-list lengths raise (upstream silently copies nothing), as do out-of-range,
  negative and repeated destination ids, and caches whose layers, block shapes or dtypes differ;
* device->device is supported next to device->pinned-host ("d2h") and pinned-host->device ("h2d");
* a copy within one cache (`copy_blocks(c, c, ...)`: copy-on-write, prefix caching) reads every
  source block before it writes any destination, so a block that is both a source and a
  destination is copied out with its old contents (as vLLM's copies of distinct blocks);
* nothing blocks: ids go up in one packed async upload, the copy is dispatched and returns.

Same-memory copies are one gather + one scatter per layer. Ids are padded to a bucket so every
count in a bucket shares one program: padded source ids are 0 (a harmless read) and padded
destination ids are P, P+1, ... (distinct, out of range, dropped by `mode="drop"`), which keeps
the `unique_indices` promise to XLA true.

Cross-memory copies run a device loop over the bucket (unrolled); padded entries repeat the last
real pair (an idempotent rewrite, since a dynamic update slice cannot drop). Each iteration moves
one block per layer with a dynamic slice, a memory-space transfer and a dynamic update slice:
XLA's host offloader turns these into DMAs of single blocks, whereas a gather/scatter on a
host-memory operand is either rejected by JAX (gather) or run as slow host compute (scatter).
One small host->device DMA per block and layer is slow, so on GPUs h2d runs the Pallas copy
kernel instead, reading the pinned source caches directly (XLA hands the host-memory operand to
the custom call unchanged), as `swap_in` reads a `HostPool`. Device->device copies on GPUs also
take the kernel: it copies each block in one pass where XLA's gather + scatter makes two.
"""

from __future__ import annotations

import functools as ft
from typing import Any, Literal

import jax
import jax.numpy as jnp

import jaxsync
from jaxsync._calls import CallCache, reads
from jaxsync._plans import PlanCache
from jaxsync.check import entry_point
from jaxsync.kv import _pallas, _pool

# Read as this module's globals at call time: tests patch `_copy._program` to count the checks.
from jaxsync.kv._copy_plan import Direction, _fields, _Program, _program
from jaxsync.kv._geometry import planned_ids
from jaxsync.kv._ids import checked_ids
from jaxsync.kv._layout import Cache
from jaxsync.kv._placement import _traced, committed, upload_ids
from jaxsync.kv._slot_plan import check_id_array


def copy_pairs(
    cache: Cache,
    src: jax.Array | jaxsync.Packed,
    dst: jax.Array | None = None,
    *,
    source: Cache | None = None,
    keys: tuple[str, str] = ("src", "dst"),
) -> Cache:
    """Copies blocks `src[k]` -> `dst[k]` in every layer: pure and traceable, for a server's own
    jit; donate the cache there (it is updated in place).

    Every source block is read before any destination is written, so a block that is both is
    copied out with its old contents (copy-on-write, prefix caching).

    Args:
      cache: `{layer: [P, ...] | (k, v)}` or a `StackedCache` (`[P, L, ...]`), device memory.
      src: the uploaded plan of `plan_copy` (its fields `keys` are read, after checking that it
        was planned for this cache and `source`: `PlanGeometryError` otherwise), with `dst`
        None; or int `[N]` source block ids on the device.
      dst: with bare `src` ids, int `[N]` unique destination block ids; padding (-1, or any id
        outside [0, P)) writes nothing.
      source: another cache of the same layers and block shapes to copy from (default: `cache`).
      keys: the plan's fields of source and destination ids.

    Returns:
      The updated cache; what `copy_blocks(source, cache, ...)` returns for the same ids.
    """
    source = cache if source is None else source
    if isinstance(src, jaxsync.Packed):
        if dst is not None:
            raise TypeError("copy_pairs takes a plan alone, or src and dst id arrays")
        num_dst, num_src = jax.tree.leaves(cache)[0].shape[0], jax.tree.leaves(source)[0].shape[0]
        dst = planned_ids(src, keys[1], (num_dst, num_src), ("blocks", "source blocks"))
        src = src[keys[0]]
    check_id_array(src, "src")
    check_id_array(dst, "dst")

    def one(s, d):  # s: [Ps, ...], d: [Pd, ...]
        blocks = s.at[src].get(mode="clip")  # [N, ...]
        # padding to distinct blocks past the end: dropped, and the indices stay unique
        num = d.shape[0]
        spare = num + jnp.arange(dst.shape[0], dtype=jnp.int32)
        to = jnp.where((dst >= 0) & (dst < num), dst.astype(jnp.int32), spare)  # [N]
        return d.at[to].set(blocks, mode="drop", unique_indices=True)

    return jax.tree.map(one, source, cache)


@ft.partial(jax.jit, donate_argnames="dst")
def _copy_same_memory(src: Cache, dst: Cache, ids: jaxsync.Packed) -> Cache:
    return copy_pairs(dst, ids["src"], ids["dst"], source=src)


@ft.partial(jax.jit, donate_argnames="cache")
def _copy_within(cache: Cache, ids: jaxsync.Packed) -> Cache:
    """`_copy_same_memory(cache, cache, ids)` with the cache passed (and donated) once: every
    source block is gathered before any destination is written."""
    return copy_pairs(cache, ids["src"], ids["dst"])


@ft.partial(jax.jit, donate_argnames="dst", static_argnames="to_host")
def _copy_cross_memory(src: Cache, dst: Cache, ids: jaxsync.Packed, to_host: bool) -> Cache:
    src_ids, dst_ids = ids["src"], ids["dst"]  # [N] each, N = bucket
    space = jax.memory.Space.Host if to_host else jax.memory.Space.Device

    def body(k, d_tree):
        def one(s, d):
            block = jax.lax.dynamic_slice_in_dim(s, src_ids[k], 1, axis=0)  # [1, ...]
            block = jax.device_put(block, space)
            return jax.lax.dynamic_update_slice_in_dim(d, block, dst_ids[k], axis=0)

        return jax.tree.map(one, src, d_tree)

    # A static trip count (the bucket): with a trip count read from device memory, XLA:GPU copies
    # the loop predicate to the host every iteration, which blocks the host. Padded entries repeat
    # the last real (src, dst) pair: rewriting the same block is idempotent.
    return jax.lax.fori_loop(0, src_ids.shape[0], body, dst, unroll=_pool.UNROLL)


@reads("shape", "sharding", "metadata")
def _checked_ids(
    program: _Program, src_ids: Any, dst_ids: Any, buckets: Any, num: tuple[int, int], near: Any
) -> jaxsync.Packed | None:
    """The ids checked against the block counts `num` (source, destination), padded to their
    bucket and uploaded next to the cache leaf `near`; None for no ids (nothing to copy)."""
    s_ids, d_ids = checked_ids(src_ids, dst_ids, *num)
    if s_ids.size == 0:
        return None
    size = jaxsync.bucket(int(s_ids.size), buckets)
    return upload_ids(_fields(program, s_ids, d_ids, size, num[1]), near)


@reads("committed")
def _commit(src: Cache, dst: Cache) -> tuple[Cache, Cache]:
    """Both caches committed where they are (jit keys on commitment: see `committed`)."""
    return committed(src), committed(dst)


# A repeated copy (the same caches' key, id content, buckets and options) skips the checks, the
# program choice and the id upload: the key covers every check it skips, by their declarations.
_KEPT_CHECKS = (_program, _checked_ids, _commit)
_KEPT = CallCache(256, checks=_KEPT_CHECKS)

# The program of each caches' key (the first part of `_KEPT`'s key: the arrays and options,
# everything `_program` reads), so new ids on known caches check and upload only the ids.
_PROGRAMS: PlanCache[_Program] = PlanCache(256)


def _dispatch(
    program: _Program, src: Cache, dst: Cache, ids: jaxsync.Packed, compiled: bool = False
) -> Cache:
    if program.within:
        return _copy_within(dst, ids)
    if program.kernel is not None:  # d2d, or h2d with the kernel reading the pinned source
        return _pallas.copy(src, dst, ids, program.kernel, compiled=compiled)
    if program.direction == "d2d":
        return _copy_same_memory(src, dst, ids)
    return _copy_cross_memory(src, dst, ids, to_host=program.direction == "d2h")


@entry_point
def copy_blocks(
    src: Cache,
    dst: Cache,
    src_ids: Any,
    dst_ids: Any,
    *,
    direction: Direction | None = None,
    buckets: tuple[int, ...] | None = None,
    impl: Literal["auto", "xla"] = "auto",
) -> Cache:
    """Copies blocks between two paged caches, or within one, every layer in one jitted call.

    Args:
      src: `{layer: [Ps, ...]}` (or (k, v) pairs), in device or pinned-host memory.
      dst: same layers, block shapes and dtypes, `[Pd, ...]`; donated: the arrays passed in are
        consumed and must not be used again; use the returned cache. `dst` may be `src` itself
        (a copy within one cache: every source block is read before any block is written).
      src_ids: host list/ndarray of source block ids.
      dst_ids: host list/ndarray of destination block ids, same length, unique.
      direction: optional "d2d", "d2h" or "h2d", checked against the caches' memory kinds
        (which alone decide what runs).
      buckets: block-count buckets (default: powers of two >= 8).
      impl: "auto" (default): on GPUs, the one-pass Pallas copy kernel for device->device and
        pinned host->device copies whose (per-device) block dims are powers of two, on one
        device or per shard for caches split over kv heads; on TPUs, a Pallas (Mosaic TPU)
        kernel moving each block HBM -> HBM by DMA for device->device copies; XLA elsewhere.
        "xla": XLA's gather + scatter (device->device) or DMA loop (across memories)
        everywhere. Device->host copies and copies within one cache always run XLA. Sharded
        caches keep their sharding with no collectives.

    Returns:
      The updated destination cache, with dst's shardings and memory kinds. With no ids, `dst`
      itself (nothing is dispatched, nothing donated).

    Raises:
      TypeError: ids that are not integers (floats, bools), caches that are not dicts of
        jax.Arrays.
      ValueError: before anything is uploaded or compiled (both caches untouched) on mismatched
        lengths, ids out of [0, P), repeated destination ids, differing layer sets / block
        shapes / dtypes, an unknown or inconsistent direction, an unsupported memory-kind pair,
        caches on different devices or meshes, deleted (donated) arrays, or a destination that
        shares some but not all arrays with the source.
    """
    options = (direction, impl, _pallas.INTERPRET, _pallas.ALLOW_COMPILED)
    run, key = _KEPT.find_tree((src, dst), options, src_ids, dst_ids, buckets)
    if run is not None:
        return run(src, dst)
    s_leaves, d_leaves = jax.tree.leaves(src), jax.tree.leaves(dst)
    # New ids on known caches (a server's every step): the cache checks are a function of the
    # caches' key, so only the ids are checked and uploaded.
    caches = key[0] if key is not None else _KEPT.tree_key((src, dst), options)
    program = None if caches is None else _PROGRAMS.peek(caches)
    if program is None or any(x.is_deleted() for x in s_leaves + d_leaves):
        program = _program(src, dst, direction, impl)  # refuses a donated cache by name
        if caches is not None:
            _PROGRAMS.put(caches, program)
    near = d_leaves[0] if program.direction == "h2d" else s_leaves[0]
    num = (s_leaves[0].shape[0], d_leaves[0].shape[0])
    ids = _checked_ids(program, src_ids, dst_ids, buckets, num, near)
    if ids is None:
        return dst
    # Every check passed for this key: later calls skip them.
    commit = not all(_traced(x) or x.committed for x in s_leaves + d_leaves)
    _KEPT.keep(key, ft.partial(_run_kept, program, ids, commit=commit))
    src, dst = _commit(src, dst)
    return _dispatch(program, src, dst, ids)


def _run_kept(
    program: _Program, ids: jaxsync.Packed, src: Cache, dst: Cache, *, commit: bool = False
) -> Cache:
    """A repeated copy's kept call: what the first call decided, run on the caches given."""
    # Checked before the launch: a deleted buffer handed to XLA fails there with
    # INVALID_ARGUMENT and an error line in the log, after part of the dispatch has run.
    if any(x.is_deleted() for x in jax.tree.leaves((src, dst))):
        raise ValueError(_DELETED)
    if commit:  # caches made uncommitted (`jnp.zeros`): committed as the first call did
        src, dst = _commit(src, dst)
    try:
        return _dispatch(program, src, dst, ids, compiled=True)
    except RuntimeError:  # deleted by another thread since the check
        if not any(x.is_deleted() for x in jax.tree.leaves((src, dst))):
            raise
    raise ValueError(_DELETED)


_DELETED = "src or dst holds a deleted (donated) array; use the returned cache"
