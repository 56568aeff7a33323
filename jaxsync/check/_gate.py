"""A gate on the device queue that the host holds closed: the dispatch probe's instrument.

The gate is a tiny jitted program whose host callback waits on a `threading.Event`. Dispatched
on a device, it holds that device's queue until the host opens it; every program dispatched on
the device afterwards runs only after it. Why that ordering holds, per client:

- CPU (PJRT's CPU client): a single-device program waits for the device's last asynchronously
  enqueued program (the client's per-device "last enqueue event" is one of its input
  dependencies), however cheap it is and whatever its inputs are. A program holding a host
  callback runs *inline* (on the dispatching thread) when nothing it depends on is pending,
  which would block the host instead of the queue. So each gate is dispatched right behind a
  "head": a few milliseconds of busy work, long enough to be still running when the gate is
  dispatched, so the gate is enqueued asynchronously and becomes the device's last enqueued
  program. Whether that worked is not assumed: the callback notes when it runs on the thread
  that dispatched it (inline; it then returns at once), and `Gate.queued` reports it so the
  caller retries with a longer head. A program spanning several devices is not ordered behind
  single-device programs (the client orders such launches only among themselves), and one
  holding a host callback always runs inline, so no gate holds it: the probe's check that the
  call's outputs are still pending behind the gate tells when a path's work escaped the gate.
- GPU/TPU: a device runs its programs in order on one stream, so any earlier program orders
  later ones; where the callback cannot hold the stream without holding the host, it runs on
  the dispatching thread and `Gate.queued` reports it too.

A timer thread opens the gate after `timeout_s` whatever happens, so a call that waits for the
device (a blocking path) never hangs the probe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import SingleDeviceSharding


class _State:
    """The gate the callbacks currently wait on (one probe at a time: `_LOCK`)."""

    event = threading.Event()
    dispatcher = 0  # thread id of the probe: a callback run there ran inline
    inline = False


_LOCK = threading.Lock()
_ZERO = np.zeros((), np.float32)


def _wait() -> np.ndarray:
    if threading.get_ident() == _State.dispatcher:
        _State.inline = True  # inline: waiting here would hold the host, not the queue
        return _ZERO
    _State.event.wait()
    return _ZERO


@jax.jit
def _gate_program(x: jax.Array) -> jax.Array:
    waited = io_callback(_wait, jax.ShapeDtypeStruct((), jnp.float32), ordered=False)
    return x + waited


class Gate:
    """A closed gate on each of `devices`.

    Use as `with Gate(devices, head, timeout_s) as gate:`; `gate.queued` says whether every
    gate was enqueued behind its head (False: retry with a longer head); `gate.open()` opens
    it, and so does the timer after `timeout_s` and the `with` block's exit.
    """

    def __init__(self, devices: Sequence[jax.Device], heads, timeout_s: float):
        self.devices = list(devices)
        self.heads = heads  # callable: (sharding) -> busy device work on that placement
        self.timeout_s = timeout_s
        self.queued = False
        self.outputs: list[jax.Array] = []
        self.timer: threading.Timer | None = None

    def _placements(self) -> list[jax.sharding.Sharding]:
        return [SingleDeviceSharding(d) for d in self.devices]

    def compile(self) -> None:
        """Compiles every head and gate program (the gate's callback returns at once here), so
        that dispatching them later costs no compile between a head and its gate."""
        with _LOCK:
            _State.event.set()
            for placement in self._placements():
                self.heads(placement).block_until_ready()
                _gate_program(jax.device_put(_ZERO, placement)).block_until_ready()

    def __enter__(self) -> Gate:
        _LOCK.acquire()
        _State.event = threading.Event()
        _State.dispatcher = threading.get_ident()
        _State.inline = False
        self.timer = threading.Timer(self.timeout_s, _State.event.set)
        self.timer.daemon = True
        self.timer.start()
        for placement in self._placements():
            self.outputs.append(self.heads(placement))
            token = jax.device_put(_ZERO, placement)
            self.outputs.append(_gate_program(token))
        self.queued = not _State.inline and not any(o.is_ready() for o in self.outputs[1::2])
        return self

    @property
    def closed(self) -> bool:
        """True until the gate is opened (by `open`, the timer or the block's exit)."""
        return not _State.event.is_set()

    def open(self) -> None:
        _State.event.set()

    def __exit__(self, *exc) -> None:
        self.open()
        try:
            if self.timer is not None:
                self.timer.cancel()
            jax.block_until_ready(self.outputs)
        finally:
            _State.dispatcher = 0
            _LOCK.release()
