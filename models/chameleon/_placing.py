"""Where the tokenizer's per-call data goes, given the pixels' placement (host checks only).

Pixels may be split over a mesh's data axis (dimension 0) and nowhere else: each device then
tokenizes whole images. The batch is padded to a multiple of that axis, the per-call metadata and
the `img2bpe` table are replicated over the same mesh, and pixels placed apart from the weights
are refused here, with a message, instead of by XLA.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding


def batch_shards(where: jax.Device | jax.sharding.Sharding | None, name: str) -> int:
    """How many ways `where` splits dimension 0 (1 for a device, None or a replicated sharding).

    Raises:
      ValueError: a sharding that splits another dimension, or one that is not a NamedSharding.
    """
    if where is None or isinstance(where, jax.Device | SingleDeviceSharding):
        return 1
    if not isinstance(where, NamedSharding):
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


def replicated_on(where: jax.Device | jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """Small per-call data next to data placed at `where`: replicated over its mesh or device."""
    if where is None:
        return None
    if isinstance(where, jax.Device):
        return SingleDeviceSharding(where, memory_kind="device")
    if isinstance(where, NamedSharding):
        return NamedSharding(where.mesh, PartitionSpec(), memory_kind="device")
    if len(where.device_set) == 1:
        (device,) = where.device_set
        return SingleDeviceSharding(device, memory_kind="device")
    raise ValueError(f"unsupported sharding {where}: use a NamedSharding over a Mesh")


def check_same_devices(where: jax.sharding.Sharding, devices: frozenset, name: str) -> None:
    """Committed inputs must live on the weights' devices (else XLA's 'incompatible devices')."""
    if where.device_set != devices:
        have = sorted(str(d) for d in where.device_set)
        want = sorted(str(d) for d in devices)
        raise ValueError(
            f"{name} lives on {have} but the VQ weights on {want}: place them on the same "
            "devices (e.g. jax.device_put with the weights' mesh)"
        )
