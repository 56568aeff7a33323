"""The cache geometry a host plan was made for, carried in its upload and checked while tracing.

A plan's ids are only right for the cache it was planned on: block ids and slots index that
cache's blocks, and the ids it was validated against (range, uniqueness) are that cache's. A
plan used on a larger cache would address real blocks with ids meant for another cache; on a
smaller one its real ids fall past the end and are silently dropped. So `plan_slots` and
`plan_copy` add one zero-size field, `"<key>.geometry"`, whose *shape* records the geometry
(shapes are static: the check costs nothing on the device and runs once per trace), and
`write_slots` / `read_slots` / `copy_pairs` given the uploaded plan compare it with the cache
they are given.
"""

from __future__ import annotations

import jax
import numpy as np

import jaxsync


SUFFIX = ".geometry"


class PlanGeometryError(ValueError):
    """A plan used on a cache of another geometry (block count, block size, source cache, or
    a read plan used for a write) than the one it was made for. Raised while tracing."""


def geometry_field(key: str, dims: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The plan field recording `dims` for the ids under `key`: int32 `[0, *dims]` (no bytes)."""
    return {key + SUFFIX: np.zeros((0, *dims), np.int32)}


def planned_ids(
    ids: jax.Array | jaxsync.Packed, key: str, dims: tuple[int, ...], names: tuple[str, ...],
    accept=None,
) -> jax.Array:  # fmt: skip
    """The ids of `key` in an uploaded plan, after checking the geometry it was planned for
    against `dims` (the cache's, named by `names`); a bare id array passes unchanged.

    `accept(planned, dims)`: whether a differing geometry is still fine (a read may use a
    write plan). Raises PlanGeometryError; KeyError when the plan has no field `key`."""
    if not isinstance(ids, jaxsync.Packed):
        return ids
    fields = {f.name: f for f in ids.layout}
    if key not in fields:
        raise KeyError(f"{key!r} is not in this plan; fields: {sorted(fields)}")
    geometry = fields.get(key + SUFFIX)
    if geometry is None:
        raise PlanGeometryError(
            f"the upload has {key!r} but no {key + SUFFIX!r}: upload the fields plan_slots / "
            f"plan_copy return, or pass the id array itself"
        )
    planned = tuple(geometry.shape[1:])
    if planned != dims and not (accept is not None and accept(planned, dims)):
        raise PlanGeometryError(
            f"{key!r} was planned for {_describe(planned, names)} but is used with "
            f"{_describe(dims, names)}; plan it for this cache"
        )
    return ids[key]


def _describe(dims: tuple[int, ...], names: tuple[str, ...]) -> str:
    return ", ".join(f"{name} {value}" for name, value in zip(names, dims, strict=False))
