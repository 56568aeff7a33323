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


@jax.jit
def _spin_loop(x: jax.Array, steps: jax.Array) -> jax.Array:
    # CPU: a dependent chain of small matmuls with a dynamic trip count (one compile).
    def body(_, y):
        return jnp.tanh(y @ y * 0.01 + 0.5)

    return jax.lax.fori_loop(0, steps, body, x)


@functools.partial(jax.jit, static_argnums=1)
def _spin_unrolled(x: jax.Array, steps: int) -> jax.Array:
    # GPU/TPU: the chain is unrolled. A while loop with a dynamic trip count is driven from the
    # host there (the predicate is read back every iteration), so it is not queued ahead at
    # dispatch and later work could slip in between its iterations.
    for _ in range(steps):
        x = jnp.tanh(x @ x * 0.01 + 0.5)
    return x


@dataclasses.dataclass(frozen=True)
class Spin:
    """Calibrated busy work on one device: `run()` queues about `target_ms` of device time."""

    x: jax.Array
    steps: Any  # a device scalar (CPU loop) or a static int (unrolled chain)
    unrolled: bool
    target_ms: float

    def run(self) -> jax.Array:
        if self.unrolled:
            return _spin_unrolled(self.x, self.steps)
        return _spin_loop(self.x, self.steps)

    def time_ms(self) -> float:
        t0 = time.perf_counter()
        self.run().block_until_ready()
        return (time.perf_counter() - t0) * 1e3


_spins: dict[Any, Spin] = {}


@jax.jit
def _gate(token: jax.Array, leaf: jax.Array) -> jax.Array:
    # optimization_barrier ties `leaf` to `token`: the result is ready only after the spin. The
    # `+ 0` keeps XLA from forwarding the input buffer unchanged (which would drop the dependency).
    token, leaf = jax.lax.optimization_barrier((token, leaf))
    return leaf + jnp.zeros((), leaf.dtype) if leaf.dtype != jnp.bool_ else leaf | False


def spin_for(device: jax.Device, queue_ms: float) -> Spin:
    """A calibrated `Spin` of about `queue_ms` on `device` (cached per device and length)."""
    key = (device, queue_ms)
    if key in _spins:
        return _spins[key]
    if device.platform == "cpu":
        x = jax.device_put(jnp.full((256, 256), 0.5, jnp.float32), device)
        steps = 16
        while True:
            spin = Spin(x, jax.device_put(steps, device), False, queue_ms)
            spin.time_ms()  # compile / warm
            ms = spin.time_ms()
            if ms >= queue_ms / 4 or steps > 1 << 24:
                break
            steps *= 4
        steps = max(1, int(steps * queue_ms / max(ms, 1e-3)))
        spin = Spin(x, jax.device_put(steps, device), False, queue_ms)
    else:
        x = jax.device_put(jnp.full((4096, 4096), 0.5, jnp.float32), device)
        probe = Spin(x, 2, True, queue_ms)
        probe.time_ms()
        per_step = probe.time_ms() / 2
        spin = Spin(x, max(1, round(queue_ms / max(per_step, 1e-3))), True, queue_ms)
    spin.time_ms()  # compile the final length outside any measurement
    _spins[key] = spin
    return spin


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
    device = arrays[0].addressable_shards[0].device if arrays else jax.devices()[0]
    spin = spin_for(device, queue_ms)
    _gate(spin.x[0, 0], spin.x[0, 0]).block_until_ready()  # compile the gate for the token shape

    blocked, queued, gated = [], [], 0
    # Outputs live until the end: rebinding `out` would free the previous one inside the timed
    # region, and freeing pinned-host memory can wait for the device (cudaFreeHost), which is
    # the caller's deallocation, not the call's dispatch.
    kept = []
    for _ in range(repeats):
        queued.append(spin.time_ms())
        busy = spin.run()
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
        kept.append(fn(*a, **k))
        blocked.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready((kept[-1], busy))
    b, q = statistics.median(blocked), statistics.median(queued)
    return BlockingReport(b, q, b / q if q > 0 else float("inf"), gated)
