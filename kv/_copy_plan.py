"""The host side of a block copy: the checks of both caches, the choice of the program that
runs it (direction, within one cache, kernel or XLA) and the ids padded to a bucket; shared by
`copy_blocks` and `plan_copy`, the host plan of a server step's `copy_pairs`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import numpy as np

import jaxsync
from jaxsync._calls import reads
from jaxsync.kv import _pallas
from jaxsync.kv._geometry import SUFFIX, geometry_field
from jaxsync.kv._ids import PAD, checked_ids, padded_ids
from jaxsync.kv._layout import Cache, cache_leaves, check_same_structure
from jaxsync.kv._placement import check_placement, check_same_sharding, memory_kind


Direction = Literal["d2d", "d2h", "h2d"]
_DIRECTIONS: dict[tuple[str, str], str] = {
    ("device", "device"): "d2d",
    ("device", "pinned_host"): "d2h",
    ("pinned_host", "device"): "h2d",
}


@dataclasses.dataclass(frozen=True)
class _Program:
    """What one call runs: the direction, whether src and dst are one cache, and the kernel
    plan (None: XLA)."""

    direction: str
    within: bool = False
    kernel: _pallas.Plan | None = None


def _direction(s_leaves: list, d_leaves: list, direction: str | None) -> str:
    """The copy's direction from the caches' memory kinds, checked against `direction`."""
    if direction is not None and direction not in ("d2d", "d2h", "h2d"):
        raise ValueError(f"unknown direction {direction!r}; expected 'd2d', 'd2h' or 'h2d'")
    kinds = (memory_kind(s_leaves, "src"), memory_kind(d_leaves, "dst"))
    if kinds not in _DIRECTIONS:
        raise ValueError(f"unsupported copy {kinds[0]} -> {kinds[1]}; one side must be device")
    actual = _DIRECTIONS[kinds]
    if direction is not None and direction != actual:
        raise ValueError(
            f"direction {direction!r} given, but the caches' memory kinds say {actual!r}"
        )
    return actual


def _within(s_leaves: list, d_leaves: list) -> bool:
    """Whether src and dst are one cache (every leaf the same array). A destination that shares
    only some arrays with the source, or holds one array twice, would be donated while also
    read, or donated twice: refused here, before anything is dispatched."""
    if len({id(x) for x in d_leaves}) != len(d_leaves):
        raise ValueError("dst holds the same array twice; each layer needs its own buffer")
    if all(s is d for s, d in zip(s_leaves, d_leaves, strict=True)):
        return True
    if {id(x) for x in s_leaves} & {id(x) for x in d_leaves}:
        raise ValueError(
            "src and dst share some but not all arrays; pass one cache as both (a copy within "
            "it) or two caches with distinct arrays"
        )
    return False


# What a kept copy's key covers of these checks: every leaf's type, shape, dtype and placement
# (memory kind, devices, sharding), both trees' structure, which leaves are one array, and the
# options (direction, impl and the kernel switches `_pallas.auto_plan` reads); "live" is
# re-checked on every call.
@reads("type", "shape", "dtype", "sharding", "live", "structure", "aliasing", "options")
def _program(src: Cache, dst: Cache, direction: str | None, impl: str) -> _Program:
    """Host checks of the caches and the choice of program, before any upload or compile."""
    if impl not in ("auto", "xla"):
        raise ValueError(f"impl must be 'auto' or 'xla', got {impl!r}")
    s_leaves, s_def = cache_leaves(src, "src")
    d_leaves, d_def = cache_leaves(dst, "dst")
    actual = _direction(s_leaves, d_leaves, direction)
    check_same_structure(src, dst, "src", "dst", flat=(s_leaves, s_def, d_leaves, d_def))
    check_placement(s_leaves + d_leaves, "src and dst")
    check_same_sharding(zip(s_leaves, d_leaves, strict=True), "src and dst")
    if _within(s_leaves, d_leaves):  # gather-then-scatter: reads every source before writing
        return _Program(actual, within=True)
    kernel = None
    if impl == "auto" and actual != "d2h":  # d2h: the DMA loop, the kernel writes device memory
        kernel = _pallas.auto_plan(s_leaves + d_leaves, tpu=actual == "d2d")
    return _Program(actual, kernel=kernel)


def _fields(program: _Program, s_ids: np.ndarray, d_ids: np.ndarray, size: int,
            num_dst: int) -> dict[str, np.ndarray]:  # fmt: skip
    """The ids padded to `size`: the fields of the call's one upload."""
    if program.direction == "d2d" or program.kernel is not None:
        # source 0 (a harmless read), distinct out-of-range destinations (dropped / skipped)
        fill_src, fill_dst = np.zeros(size), np.arange(num_dst, num_dst + size)
    else:  # the cross-memory loop has no dropping scatter: repeat the last pair
        fill_src, fill_dst = np.full(size, s_ids[-1]), np.full(size, d_ids[-1])
    return {"src": padded_ids(s_ids, fill_src), "dst": padded_ids(d_ids, fill_dst)}


def plan_copy(
    cache: Cache, src_ids: Any, dst_ids: Any, *, buckets: tuple[int, ...] | None = None,
    source: Cache | None = None, keys: tuple[str, str] = ("src", "dst"),
) -> dict[str, np.ndarray]:  # fmt: skip
    """The host plan of a server step's `copy_pairs`.

    Validates what `copy_blocks(source, cache, src_ids, dst_ids)` validates (device memory on
    both sides), on the host, and pads the ids to a bucket: padded sources read block 0,
    padded destinations are -1 (nothing written). Put the fields in the step's one
    `jaxsync.upload_packed` and pass the uploaded plan to `copy_pairs`, which checks, while
    tracing, that it was planned for the caches it is given (`PlanGeometryError` otherwise).

    Args:
      cache: the destination cache (host metadata only: shapes, memory kind, placement).
      src_ids, dst_ids: host lists/ndarrays of block ids, same length, `dst_ids` unique.
      buckets: block-count buckets (default: powers of two >= 8).
      source: the cache copied from, when not `cache` itself.
      keys: the two fields' names.

    Returns:
      `{keys[0]: int32 [N], keys[1]: int32 [N], keys[1] + ".geometry": int32 [0, P, Ps]}`,
      N = bucket(len(src_ids)); the last field records the block counts of `cache` and
      `source` in its shape (no bytes uploaded).

    Raises:
      TypeError, ValueError: as `copy_blocks`, before anything is uploaded.
    """
    if (
        len(keys) != 2
        or not all(isinstance(k, str) for k in keys)
        or len({*keys, keys[1] + SUFFIX}) != 3
    ):
        raise ValueError(f"keys must be two distinct field names, got {keys!r}")  # one would vanish
    source = cache if source is None else source
    _program(source, cache, "d2d", "xla")  # the cache checks copy_blocks makes
    num_src, num_dst = jax.tree.leaves(source)[0].shape[0], jax.tree.leaves(cache)[0].shape[0]
    s_ids, d_ids = checked_ids(src_ids, dst_ids, num_src, num_dst)
    size = jaxsync.bucket(int(s_ids.size), buckets)
    fields = {
        keys[0]: padded_ids(s_ids, np.zeros(size)),  # block 0: a harmless read
        keys[1]: padded_ids(d_ids, np.full(size, PAD)),  # no block of any cache: dropped
    }
    return {**fields, **geometry_field(keys[1], (num_dst, num_src))}
