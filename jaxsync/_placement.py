"""Placement: where a host table or upload lands (a device, a sharding, or the default device),
and the one rule of an entry's per-call data:

- host data goes to the entry's `placement`: the caller's, else replicated beside the weights;
- host metadata goes replicated beside that placement (`replicated(placement, "device")`);
- a device input's metadata goes replicated beside the input (`replicated_near`);
- a placement or a device input on other devices than the weights is refused on the host
  (`check_devices`), naming both, before JAX would fail with "incompatible devices".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeAlias

import jax


Placement: TypeAlias = jax.Device | jax.sharding.Sharding | None


def resolve(placement: Placement) -> jax.Device | jax.sharding.Sharding:
    """Returns a concrete device or sharding; `None` means JAX's default device."""
    if placement is None:
        default = jax.config.jax_default_device
        if isinstance(default, str):  # jax also takes a platform name there, e.g. "cpu"
            return jax.devices(default)[0]
        return default or jax.devices()[0]
    if isinstance(placement, jax.Device | jax.sharding.Sharding):
        return placement
    raise TypeError(f"placement must be a jax.Device, a Sharding or None, got {type(placement)}")


def placement_of(x: jax.Array) -> jax.sharding.Sharding:
    """The sharding a device array lives on (its memory kind included)."""
    return x.sharding


def devices_of(where: jax.Device | jax.sharding.Sharding | jax.Array) -> frozenset:
    """The devices of a `jax.Device`, a `Sharding` or a concrete array."""
    if isinstance(where, jax.Device):
        return frozenset((where,))
    if isinstance(where, jax.Array):
        where = where.sharding
    return frozenset(where.device_set)


def committed(x: jax.Array) -> jax.sharding.Sharding | None:
    """Where committed device input lives (None: traced by a static scan, or uncommitted)."""
    if isinstance(x, jax.core.Tracer) or not x.committed:
        return None
    return x.sharding


def check_devices(
    where: Any, devices: Iterable[jax.Device], name: str, *, other: str = "the weights"
) -> None:
    """Refuses `where` (a device, a sharding or an array) on other devices than `devices`,
    naming both (`other` names what `devices` are). A traced array passes: its placement is
    the jit's.

    Raises:
      ValueError: the two device sets differ.
    """
    if isinstance(where, jax.core.Tracer):
        return
    have, want = devices_of(where), frozenset(devices)
    if have != want:
        shown = "" if isinstance(where, jax.Array) else f" ({where})"
        raise ValueError(
            f"{name}{shown} on devices {_ids(have)}, but {other} on devices {_ids(want)}: put "
            "them on the same devices"
        )


def entry_placement(placement: Any, weights: jax.Array) -> jax.Device | jax.sharding.Sharding:
    """Where an entry's host data goes: `placement`, else replicated beside `weights` (over
    their mesh, or on their device).

    Raises:
      TypeError: `placement` is not a `jax.Device`, a `Sharding` or None.
      ValueError: `placement` is on other devices than `weights`.
    """
    if placement is None:
        return replicated(weights.sharding)
    resolve(placement)  # the type check
    check_devices(placement, weights.sharding.device_set, "placement")
    return placement


def batch_split(where: Placement, name: str) -> int:
    """How many ways `where` splits dimension 0 (1 for a device, None or a replicated sharding).

    Raises:
      ValueError: a sharding that splits another dimension, or one that is not a NamedSharding.
    """
    if where is None or isinstance(where, jax.Device | jax.sharding.SingleDeviceSharding):
        return 1
    if not isinstance(where, jax.sharding.NamedSharding):
        if where.is_fully_replicated:
            return 1
        raise ValueError(f"{name}: use a NamedSharding over a Mesh, got {where}")
    spec = tuple(where.spec)
    if any(entry is not None for entry in spec[1:]):
        raise ValueError(
            f"{name} may be split over the batch axis only (dimension 0), got spec {where.spec}"
        )
    if not spec or spec[0] is None:
        return 1
    names = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    return math.prod(where.mesh.shape[a] for a in names)


def replicated(placement: Placement, memory_kind: str | None = None) -> Placement:
    """Where per-call metadata goes beside data placed at `placement`: replicated over a
    `NamedSharding`'s mesh (in `memory_kind`), else `placement` itself (a device, or a
    one-device sharding)."""
    if isinstance(placement, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(
            placement.mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind
        )
    return placement


def replicated_near(x: jax.Array) -> jax.sharding.Sharding | None:
    """Where small per-call data used together with `x` goes: device memory on `x`'s device, or
    replicated over `x`'s mesh. None while `x` is traced (e.g. by the static scans of
    `jaxsync.check`), where placement does not matter.

    >>> import jax.numpy as jnp
    >>> replicated_near(jnp.ones(3)).memory_kind
    'device'
    """
    if isinstance(x, jax.core.Tracer):
        return None
    sharding = x.sharding
    near = _NEAR.get(sharding)
    if near is None:
        near = _NEAR[sharding] = _replicated(sharding)
    return near


def _ids(devices: frozenset) -> list[int]:
    return sorted(d.id for d in devices)


# x.sharding -> replicated_near's answer: a call costs a lookup, not a new sharding object
# (shardings are hashable, and a process sees a handful of them).
_NEAR: dict[jax.sharding.Sharding, jax.sharding.Sharding] = {}


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(), memory_kind="device"
        )
    if len(sharding.device_set) == 1:
        (device,) = sharding.device_set
        return jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    raise ValueError(f"unsupported sharding {sharding}: use a NamedSharding over a Mesh")
