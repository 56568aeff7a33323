"""Pinned host memory: where it exists, the transfer out of it, and numpy views of its buffers.

The plumbing under `StagingRing`. A device offers pinned memory when it lists a `pinned_host`
memory kind; a device whose pinned buffers once failed to allocate, map or move joins
`UNUSABLE` and takes the pageable path from then on. Allocating a pinned buffer is slow
(cudaHostAlloc), so it runs on one background thread (`grower`).

`StagingRing` reads every name here through this module (`_pinned.transfer`, ...), never a copy
bound at import: a test that patches one here patches what the ring calls.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import threading
from typing import Any

import jax
import numpy as np

from jaxsync._placement import Placement, resolve


def is_ready(out: jax.Array) -> bool:
    """Whether the transfer that produced `out` has finished reading its pinned source."""
    return out.is_ready()


UNUSABLE: set[jax.Device] = set()  # devices whose pinned buffers failed to set up


@functools.cache
def _pinned_memory(device: jax.Device) -> jax.sharding.Sharding | None:
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def memory(device: jax.Device) -> jax.sharding.Sharding | None:
    """The device's pinned host memory as a sharding, or None where it has none (or where
    setting up a buffer there failed once)."""
    return None if device in UNUSABLE else _pinned_memory(device)


def single_device(placement: Placement) -> jax.sharding.Sharding | None:
    """The sharding of a one-device placement in device memory, or None (several devices, or
    host memory): those take the pageable path."""
    target = resolve(placement)
    if isinstance(target, jax.Device):
        target = jax.sharding.SingleDeviceSharding(target)
    if len(target.device_set) != 1 or target.memory_kind not in (None, "device"):
        return None
    # Named explicitly: a transfer out of pinned memory to an unnamed memory kind may stay in
    # host memory on some runtimes.
    return target.with_memory_kind("device")


@functools.cache
def copy_program(target: jax.sharding.Sharding) -> Any:
    # Identity with the device placement as its output: XLA emits the pinned->device DMA.
    return jax.jit(lambda x: x, out_shardings=target)


def transfer(stage: jax.Array, target: jax.sharding.Sharding, form: str | None = None) -> jax.Array:
    """The pinned->device transfer of `stage`, in the form with the least host time per backend.

    `form` "put" (the default): `jax.device_put` to device memory, the runtime's own
    memory-kind transfer. "jit": a cached jitted identity with `out_shardings` (less host time
    on a GPU, but it runs on the compute stream, behind the forwards). The transfer guard
    accepts both; `StagingRing.upload` refuses any result that is not in device memory.
    """
    if form is None:
        form = "put"
    if form == "put":
        return jax.device_put(stage, target)
    return copy_program(target)(stage)


_GROWER: list[concurrent.futures.ThreadPoolExecutor] = []
_GROWER_LOCK = threading.Lock()


def grower() -> concurrent.futures.ThreadPoolExecutor:
    """The one background thread that allocates pinned buffers."""
    with _GROWER_LOCK:
        if not _GROWER:
            _GROWER.append(
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxsync-staging")
            )
        return _GROWER[0]


def view(stage: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A writable `[shape]` numpy view of pinned buffer `stage` (raises where the backend gives
    no host pointer to it)."""
    raw = (ctypes.c_byte * stage.nbytes).from_address(stage.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype).reshape(shape)
