"""Where each loaded parameter goes: a per-parameter callable, a partition-rule table, or a default.

A rule table is `[(regex over the NNX parameter path, axes), ...]`, `axes` being a
PartitionSpec-like tuple of mesh axis names (or tuples of them, or None). One table serves every
mesh: axis names the mesh lacks are dropped, and a dimension its axes do not divide is replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsync.weights._checkpoint import WeightError


Axes = Sequence[str | Sequence[str] | None] | None
PartitionRules = Sequence[tuple[str, Axes]]
ShardingFn = Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None]
Placement = jax.sharding.Sharding | jax.Device


def partition_spec(axes: Axes, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`axes` fitted to `mesh` and `shape`: unknown axis names and non-dividing axes dropped."""
    if axes is None:
        return PartitionSpec()
    if len(axes) > len(shape):
        raise WeightError(f"partition axes {tuple(axes)} have more entries than shape {shape}")
    spec = []
    for entry, size in zip(axes, shape, strict=False):  # missing entries replicate
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(n for n in names if n in mesh.shape)
        if not names or size % math.prod(mesh.shape[n] for n in names):
            spec.append(None)
        else:
            spec.append(names[0] if len(names) == 1 else names)
    return PartitionSpec(*spec)


def placement(
    path: str,
    shape: tuple[int, ...],
    *,
    sharding: ShardingFn | None,
    mesh: Mesh | None,
    partition_rules: PartitionRules | None,
    default: jax.Device,
) -> Placement:
    """The sharding (or device) of parameter `path`, checked to fit `shape` before any upload.

    Order: `sharding(path, shape)` when it returns one; else the first rule whose regex
    `re.search`es `path` (with a mesh); else replicated over `mesh`; else `default`.
    """
    place: Placement | None = sharding(path, shape) if sharding else None
    if place is None and mesh is not None:
        axes = next((a for r, a in partition_rules or () if re.search(r, path)), None)
        try:
            place = NamedSharding(mesh, partition_spec(axes, shape, mesh))
        except WeightError as e:
            raise WeightError(f"parameter {path!r}: {e}") from None
    if place is None:
        return default
    if isinstance(place, jax.sharding.Sharding):
        try:
            place.shard_shape(shape)
        except ValueError as e:
            raise WeightError(
                f"parameter {path!r} of shape {shape} cannot take {place}: {e}"
            ) from None
    return place


def param_placement(
    target: str,
    shape: tuple[int, ...],
    layered: bool,
    sharding: ShardingFn | None,
    mesh: Mesh | None,
    partition_rules: PartitionRules | None,
    default: jax.Device,
) -> Placement:
    """Where parameter `target` goes; a stacked one is placed by its rule for one layer, with
    the layer axis unsharded in front."""
    if not layered:
        return placement(
            target,
            shape,
            sharding=sharding,
            mesh=mesh,
            partition_rules=partition_rules,
            default=default,
        )
    if sharding is not None and (chosen := sharding(target, shape)) is not None:
        return placement(
            target,
            shape,
            sharding=lambda *_: chosen,
            mesh=None,
            partition_rules=None,
            default=default,
        )
    layer = placement(
        target,
        shape[1:],
        sharding=None,
        mesh=mesh,
        partition_rules=partition_rules,
        default=default,
    )
    if isinstance(layer, NamedSharding):
        return NamedSharding(layer.mesh, PartitionSpec(None, *layer.spec))
    return layer
