"""Placement: where a host table or upload lands (a device, a sharding, or the default device)."""

from __future__ import annotations

from typing import TypeAlias

import jax


Placement: TypeAlias = jax.Device | jax.sharding.Sharding | None


def resolve(placement: Placement) -> jax.Device | jax.sharding.Sharding:
    """Returns a concrete device or sharding; `None` means JAX's default device."""
    if placement is None:
        return jax.config.jax_default_device or jax.devices()[0]
    if isinstance(placement, jax.Device | jax.sharding.Sharding):
        return placement
    raise TypeError(f"placement must be a jax.Device, a Sharding or None, got {type(placement)}")


def placement_of(x: jax.Array) -> jax.sharding.Sharding:
    """The sharding a device array lives on (its memory kind included)."""
    return x.sharding
