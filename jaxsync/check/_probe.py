"""Dispatch probe: does a call return while the device is still busy, or does it wait?

The probe queues several milliseconds of device work, makes `fn`'s device inputs depend on it, and
times how long `fn` takes to *return*. A sync-free `fn` returns after its dispatch cost; a `fn` that
reads a device value back (or waits on it) returns only after the queued work is done.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding


@dataclasses.dataclass(frozen=True)
class BlockingReport:
    """Result of `measure_blocking`.

    Attributes:
      blocked_ms: median time for `fn` to return, with the queued work ahead of it.
      queued_ms: median duration of the queued device work alone.
      fraction: blocked_ms / queued_ms (about 0 for a sync-free fn, about 1 for a blocking one).
      gated_inputs: how many device inputs were made to depend on the queued work.
    """

    blocked_ms: float
    queued_ms: float
    fraction: float
    gated_inputs: int

    def __str__(self) -> str:
        return (
            f"blocked {self.blocked_ms:.3f} ms of {self.queued_ms:.1f} ms queued "
            f"({100 * self.fraction:.1f}%)"
        )


@functools.partial(jax.jit, static_argnums=())
def _spin(x: jax.Array, steps: jax.Array) -> jax.Array:
    # A dependent chain of small matmuls: runs `steps` iterations, cannot be optimised away.
    def body(_, y):
        return jnp.tanh(y @ y * 0.01 + 0.5)

    return jax.lax.fori_loop(0, steps, body, x)


@jax.jit
def _gate(token: jax.Array, leaf: jax.Array) -> jax.Array:
    # optimization_barrier ties `leaf` to `token`: the result is ready only after the spin.
    return jax.lax.optimization_barrier((token, leaf))[1]


_calibration: dict[Any, int] = {}


def _time_spin(x: jax.Array, steps: int) -> float:
    n = jax.device_put(steps, x.sharding)
    t0 = time.perf_counter()
    _spin(x, n).block_until_ready()
    return (time.perf_counter() - t0) * 1e3


def _calibrated_steps(device: jax.Device, queue_ms: float) -> tuple[jax.Array, int]:
    x = jax.device_put(jnp.full((256, 256), 0.5, jnp.float32), device)
    key = (device, queue_ms)
    if key not in _calibration:
        steps = 16
        _time_spin(x, steps)  # compile
        while True:
            ms = _time_spin(x, steps)
            if ms >= queue_ms / 4 or steps > 1 << 24:
                break
            steps *= 4
        _calibration[key] = max(1, int(steps * queue_ms / max(ms, 1e-3)))
    return x, _calibration[key]


def _token_for(leaf: jax.Array, token: jax.Array) -> jax.Array | None:
    sharding = leaf.sharding
    if getattr(sharding, "memory_kind", None) not in (None, "device"):
        return None  # host-memory inputs cannot be gated through a device computation
    if isinstance(sharding, SingleDeviceSharding):
        return jax.device_put(token, sharding)
    if isinstance(sharding, NamedSharding):
        return jax.device_put(token, NamedSharding(sharding.mesh, PartitionSpec()))
    return None


def measure_blocking(
    fn: Callable[..., Any], *args: Any, queue_ms: float = 30.0, repeats: int = 3, **kwargs: Any
) -> BlockingReport:
    """Times how long `fn(*args)` blocks the host while `queue_ms` of device work is queued.

    `fn` is called once first (outside the measurement) to compile. Its outputs are awaited outside
    the timed region.

    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda x: x * 2)
    >>> measure_blocking(f, jnp.ones(8), queue_ms=5).fraction < 0.5
    True
    """
    jax.block_until_ready(fn(*args, **kwargs))  # warm-up / compile
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
    device = arrays[0].sharding._device_assignment[0] if arrays else jax.devices()[0]
    x, steps = _calibrated_steps(device, queue_ms)
    n = jax.device_put(steps, device)
    _gate(x[0, 0], x[0, 0]).block_until_ready()  # compile the gate for the token shape

    blocked, queued, gated = [], [], 0
    for _ in range(repeats):
        queued.append(_time_spin(x, steps))
        busy = _spin(x, n)
        token = busy[0, 0]
        new_leaves, gated = [], 0
        for leaf in leaves:
            if isinstance(leaf, jax.Array):
                t = _token_for(leaf, token)
                if t is not None:
                    leaf = _gate(t, leaf)
                    gated += 1
            new_leaves.append(leaf)
        a, k = jax.tree_util.tree_unflatten(treedef, new_leaves)
        t0 = time.perf_counter()
        out = fn(*a, **k)
        blocked.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready((out, busy))
    b, q = statistics.median(blocked), statistics.median(queued)
    return BlockingReport(b, q, b / q if q > 0 else float("inf"), gated)
