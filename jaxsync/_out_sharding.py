"""Where a tower's output rows go: the `out_sharding` option of every family's forward and
entry.

A tower whose weights are split over a mesh's "model" axis computes its rows from partial sums
that every model shard ends up holding; left to the compiler, the rows may come out split over
the feature axis, which the server's next op (a scatter into its token embeddings) would have to
gather. The forwards therefore constrain their rows: by default replicated over the mesh the
weights live on, or as the server asks (e.g. `P("data")` for a batch it splits over "data").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jaxsync._placement import check_devices


OutSharding = Sharding | PartitionSpec | None
"""A forward's `out_sharding`: a `Sharding`, a `PartitionSpec` over the weights' mesh, or None
(rows replicated over the weights' mesh; unconstrained when the weights are on one device)."""


def weights_mesh(model: nnx.Module) -> Any:
    """The (abstract) mesh the model's weights are placed on, or None for unsharded weights.

    Read from the leaves' types, so it works on concrete arrays and inside a server's jit over
    the state leaves alike (a tracer's type carries its argument's mesh).
    """
    for leaf in jax.tree.leaves(nnx.state(model)):
        if not isinstance(leaf, jax.Array):  # e.g. a packed single-placement state's buffers
            continue
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            # inside a shard_map the body sees per-shard values: nothing to place there
            manual = any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)
            return None if manual else mesh
    return None


def place_rows(model: nnx.Module, x: jax.Array, out_sharding: OutSharding = None) -> jax.Array:
    """`x` constrained to `out_sharding` (see `OutSharding`) inside the forward's trace.

    Raises:
      ValueError: a `PartitionSpec` for a model whose weights are on no mesh (nothing names
        the devices it would refer to).
    """
    if isinstance(out_sharding, Sharding):
        return jax.lax.with_sharding_constraint(x, out_sharding)
    mesh = weights_mesh(model)
    if mesh is None:
        if out_sharding is not None:
            raise ValueError(_no_mesh(out_sharding))
        return x
    spec = PartitionSpec() if out_sharding is None else out_sharding
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def check_out_sharding(
    model: nnx.Module, out_sharding: Any, weights: frozenset[jax.Device]
) -> OutSharding:
    """`out_sharding` checked at an entry's construction, before anything compiles: what
    `place_rows` would refuse while tracing, and what it could not read. `weights`: the
    devices the model's weights live on (the program's).

    Raises:
      TypeError: anything but a `Sharding`, a `PartitionSpec` or None.
      ValueError: a `Sharding` on other devices than the weights; a `PartitionSpec` for weights
        on no mesh, or naming axes their mesh lacks.
    """
    if out_sharding is None:
        return None
    if isinstance(out_sharding, Sharding):
        check_devices(out_sharding, weights, "out_sharding")
        return out_sharding
    if not isinstance(out_sharding, PartitionSpec):
        raise TypeError(
            "out_sharding must be a Sharding, a PartitionSpec over the weights' mesh or None, "
            f"got {type(out_sharding).__name__}"
        )
    mesh = weights_mesh(model)
    if mesh is None:
        raise ValueError(_no_mesh(out_sharding))
    names = {a for part in out_sharding if part is not None for a in _axes(part)}
    if not names <= set(mesh.axis_names):
        raise ValueError(
            f"out_sharding={out_sharding} names axes {sorted(names - set(mesh.axis_names))} "
            f"that the weights' mesh lacks (its axes: {list(mesh.axis_names)})"
        )
    return out_sharding


def _axes(part: Any) -> tuple:
    return (part,) if isinstance(part, str) else tuple(part)


def _no_mesh(out_sharding: PartitionSpec) -> str:
    return (
        f"out_sharding={out_sharding} is a PartitionSpec but the tower's weights are on no "
        "mesh: pass a NamedSharding"
    )


@functools.cache
def with_out_sharding(forward: Callable[..., Any], out_sharding: OutSharding) -> Callable:
    """`forward` with `out_sharding` bound, one function object per pair, so entries that ask
    for the same placement share one compiled program (programs are keyed by the function)."""
    if out_sharding is None:
        return forward
    return functools.partial(forward, out_sharding=out_sharding)
