"""Placement: where a host table or upload lands (a device, a sharding, or the default device)."""

from __future__ import annotations

from typing import TypeAlias

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
