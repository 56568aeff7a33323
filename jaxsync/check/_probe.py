"""Dispatch probe: does a call return while the device queue is held, or does it wait?

The probe closes a gate on the device queue (`_gate.Gate`: a program whose host callback waits
on an event the host holds), calls `fn`, and checks three things while the gate is still
closed: the call returned; at least one of its device outputs is not ready yet, so its work
really is queued behind the gate (the construction is checked, not assumed); and the gate was
still closed when the call returned. Then it opens the gate and waits for the outputs. A `fn`
that reads a device value back (or waits on one) cannot return before the gate opens: a timer
opens it after `timeout_s`, and the probe reports the wait. No ratio of timings decides the
verdict, so a loaded machine cannot flip it; the host time of the call is reported as
information.

Where no gate can be queued (a client that runs the gate's callback on the dispatching thread),
the probe falls back to timing the call behind a few milliseconds of queued busy work and says
so in its report. A call whose arrays span several CPU devices is reported as not proven: the
CPU client orders such programs only among themselves, so no gate holds them.
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

from jaxsync.check._gate import Gate


@dataclasses.dataclass(frozen=True)
class BlockingReport:
    """Result of `measure_blocking`.

    Attributes:
      blocked_ms: median host time for `fn` to return with the device queue held (information).
      queued_ms: how long the queue was held at most (the gate's timeout), or the timed
        fallback's queued device work.
      fraction: blocked_ms / queued_ms (about 0 for a sync-free fn, about 1 for a blocking one).
      gated_inputs: how many devices were gated.
      ok: the verdict: True when every call returned while the queue was held with its work
        queued behind the gate, False when a call waited, None when the call's work escaped the
        gate (nothing proven either way).
      detail: which check failed, or how the verdict was reached.
      method: "gate" (the host-held gate) or "timed" (the fallback).
    """

    blocked_ms: float
    queued_ms: float
    fraction: float
    gated_inputs: int
    ok: bool | None = True
    detail: str = ""
    method: str = "gate"

    def __str__(self) -> str:
        if self.method == "timed":
            return (
                f"timed: blocked {self.blocked_ms:.3f} ms of {self.queued_ms:.1f} ms queued "
                f"({100 * self.fraction:.1f}%)" + (f"; {self.detail}" if self.detail else "")
            )
        if self.ok is None:
            return self.detail
        return f"{self.detail} (returned in {self.blocked_ms:.3f} ms)"


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


_HEAD_MS = 4.0  # a gate's head: busy work still running when the gate is dispatched right after
_ATTEMPTS = 5  # heads of 4, 16, 64, 256 and 1024 ms before falling back to the timed probe
_heads: dict[Any, tuple[jax.Array, Any]] = {}


def _head_runner(device: jax.Device, scale: int) -> Callable[[jax.sharding.Sharding], jax.Array]:
    """`run(placement)` dispatches about `_HEAD_MS * scale` of busy work on `placement`."""
    spin = spin_for(device, _HEAD_MS)

    def run(placement: jax.sharding.Sharding) -> jax.Array:
        key = (placement, scale)
        if key not in _heads:
            steps = spin.steps if spin.unrolled else int(jax.device_get(spin.steps))
            steps *= scale
            x = jax.device_put(spin.x, placement)
            _heads[key] = (x, steps if spin.unrolled else jax.device_put(steps, placement))
        x, steps = _heads[key]
        return Spin(x, steps, spin.unrolled, _HEAD_MS * scale).run()

    return run


def _devices(tree: Any) -> list[jax.Device]:
    """The devices holding `tree`'s device arrays, in first-seen order (the default device when
    it holds none)."""
    seen: dict[jax.Device, None] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            for shard in leaf.addressable_shards:
                seen.setdefault(shard.device, None)
    return list(seen) or [jax.devices()[0]]


def _spans_several_devices(tree: Any) -> bool:
    return any(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and len(x.devices()) > 1
        for x in jax.tree_util.tree_leaves(tree)
    )


def _device_outputs(out: Any) -> list[jax.Array]:
    return [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]


def _gated_call(fn, args, kwargs, devices, timeout_s):
    """One call of `fn` behind closed gates: (host ms, verdict, detail, outputs), or None when no
    gate could be queued (see `_gate`). The verdict is None when the call's work escaped the
    gate (nothing is proven then)."""
    for attempt in range(_ATTEMPTS):
        gate = Gate(devices, _head_runner(devices[0], 4**attempt), timeout_s)
        if attempt == 0:
            gate.compile()
        with gate:
            if not gate.queued:
                continue  # the head finished before its gate was dispatched: a longer head
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            ms = (time.perf_counter() - t0) * 1e3
            returned_closed = gate.closed
            outputs = _device_outputs(out)
            pending = [x for x in outputs if not x.is_ready()]
            checked_closed = gate.closed  # readiness above was read with the queue still held
        if not returned_closed:
            return (
                ms,
                False,
                f"blocked: returned only after the gate opened ({ms / 1e3:.1f} s)",
                out,
            )
        if outputs and not pending and checked_closed:
            text = "not proven: the call's outputs were ready while the gate was closed (work on "
            return ms, None, text + "programs spanning several devices is not held by it)", out
        return ms, True, "", out
    return None


def measure_blocking(
    fn: Callable[..., Any],
    *args: Any,
    queue_ms: float = 30.0,
    repeats: int = 3,
    timeout_s: float = 20.0,
    max_blocked_fraction: float = 0.5,
    **kwargs: Any,
) -> BlockingReport:
    """Proves that `fn(*args)` returns while the device queue is held by a closed gate.

    `fn` is called once first (outside the measurement) to compile; that call's outputs also
    tell which devices its programs use, and every device of its inputs and outputs is gated.
    Then `repeats` calls each run behind a closed gate (see the module docstring); the first
    failing call decides.

    Args:
      fn: the entry point.
      *args: its arguments (never altered: the gate is a separate program on the same devices).
      queue_ms: the timed fallback's queued device work.
      repeats: gated calls.
      timeout_s: how long a gate stays closed at most (a blocking call waits this long).
      max_blocked_fraction: the timed fallback's verdict threshold.
      **kwargs: keyword arguments for `fn`.

    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda x: x * 2)
    >>> measure_blocking(f, jnp.ones(8)).ok
    True
    """
    first = fn(*args, **kwargs)
    jax.block_until_ready(first)  # warm-up / compile
    devices = _devices((args, kwargs, first))
    if devices[0].platform == "cpu" and _spans_several_devices((args, kwargs, first)):
        # The CPU client runs such programs from its own worker threads, which the gates' waiting
        # callbacks occupy, and orders them only among themselves: no gate holds them.
        note = (
            "not proven: the call runs programs spanning several CPU devices, which no gate holds"
        )
        return BlockingReport(0.0, 0.0, 0.0, len(devices), None, note)
    kept, times = [first], []  # outputs live until the end: freeing can wait for the device
    for _ in range(repeats):
        call = _gated_call(fn, args, kwargs, devices, timeout_s)
        if call is None:
            return _timed(fn, args, kwargs, devices, queue_ms, repeats, max_blocked_fraction)
        ms, verdict, detail, out = call
        kept.append(out)
        times.append(ms)
        jax.block_until_ready(out)
        if verdict is not True:
            hold = timeout_s * 1e3
            return BlockingReport(ms, hold, ms / hold, len(devices), verdict, detail)
    b = statistics.median(times)
    detail = f"returned with the queue of {len(devices)} device(s) held, {repeats} call(s)"
    return BlockingReport(b, timeout_s * 1e3, b / (timeout_s * 1e3), len(devices), True, detail)


def _timed(fn, args, kwargs, devices, queue_ms, repeats, max_fraction) -> BlockingReport:
    """The fallback: `fn`'s host time with `queue_ms` of busy work queued ahead on its devices."""
    spins = [spin_for(d, queue_ms) for d in devices]
    blocked, queued, kept = [], [], []
    for _ in range(repeats):
        queued.append(spins[0].time_ms())
        busy = [s.run() for s in spins]
        t0 = time.perf_counter()
        kept.append(fn(*args, **kwargs))
        blocked.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready((kept[-1], busy))
    b, q = statistics.median(blocked), statistics.median(queued)
    fraction = b / q if q > 0 else float("inf")
    note = "no gate could be queued on this client"
    return BlockingReport(b, q, fraction, len(devices), fraction < max_fraction, note, "timed")
