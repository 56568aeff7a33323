"""Timing that means the same thing for JAX and PyTorch on one accelerator.

- device time per forward: queue a known amount of busy work first, then dispatch `k` forwards,
  wait, and subtract the busy time. The device never idles waiting for the host, so this is device
  time even when dispatch is slow (the forwards queue up behind the busy work and run after it).
- host-blocked time: queue ~30 ms of busy work, then time how long one forward takes to return
  (a cold call: the thread has just waited for the device, as a server does after a sync).
- stream host time: the same, per call, for the 2nd..k-th of k back-to-back forwards (what each
  call costs a thread that keeps dispatching while the device is busy).
- first call: wall time of the first call, compile included.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from jaxsync.harness.bench._programs import main_program_args


class _Side:
    """Busy work and synchronisation for one framework."""

    def __init__(self, framework: str):
        self.framework = framework
        if framework == "jax":
            import jax
            import jax.numpy as jnp

            from jaxsync.check._probe import spin_for

            self._spin = spin_for(jax.devices()[0], 30.0).run
            self._sync = jax.block_until_ready
            self._jnp = jnp
        else:
            import torch

            x = torch.full((1024, 1024), 0.5, device="cuda")
            self._x = x
            self._steps = self._calibrate_torch()
            self._spin = self._torch_spin
            self._sync = lambda _=None: torch.cuda.synchronize()

    def _torch_spin(self, steps: int | None = None):
        import torch

        y = self._x
        for _ in range(steps or self._steps):
            y = torch.tanh(y @ y * 0.001 + 0.5)
        return y

    def _calibrate_torch(self) -> int:
        import torch

        steps = 4
        self._torch_spin(steps)
        while True:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self._torch_spin(steps)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            if ms > 8 or steps > 1 << 16:
                return max(1, int(steps * 30.0 / ms))
            steps *= 2

    def busy_ms(self) -> float:
        self._sync(None)
        t0 = time.perf_counter()
        self._sync(self._spin())
        return (time.perf_counter() - t0) * 1e3

    def spin(self) -> Any:
        return self._spin()

    def sync(self, out: Any = None) -> None:
        self._sync(out)


def _last(outs: list[Any]) -> Any:
    # Only the last output is waited on: one stream runs the forwards in order, and a path that
    # donates (a KV copy chain) has already consumed every earlier output.
    return outs[-1]


def _forwards_per_sample(fn: Callable[[], Any], side: _Side) -> int:
    # Enough back-to-back forwards for ~10 ms of work, so the busy-work subtraction (noise ~0.1 ms)
    # stays small against the total, yet few enough to queue behind the ~30 ms spin.
    side.sync()
    t0 = time.perf_counter()
    side.sync(_last([fn() for _ in range(5)]))
    per_call = max((time.perf_counter() - t0) * 1e3 / 5, 1e-3)
    # At least 2: a slow forward (>= 5 ms) already gives the ~10 ms sample on its own.
    return int(min(max(10.0 / per_call, 2), 1000))


def blocked_ms(fn: Callable[[], Any], side: _Side) -> float:
    """One host-blocked sample: ms for `fn()` to return with ~30 ms of device work queued."""
    side.sync()
    side.spin()
    t0 = time.perf_counter()
    out = fn()
    ms = (time.perf_counter() - t0) * 1e3
    side.sync(out)
    return ms


def measure(fn: Callable[[], Any], side: _Side, *, repeat: int = 5) -> dict[str, float]:
    """First-call time, device time per forward, and host-blocked time for a zero-arg closure."""
    t0 = time.perf_counter()
    side.sync(fn())
    first_ms = (time.perf_counter() - t0) * 1e3
    side.sync(fn())
    k = _forwards_per_sample(fn, side)

    device, blocked, stream = [], [], []
    for _ in range(repeat):
        busy = side.busy_ms()
        side.sync()
        t0 = time.perf_counter()
        side.spin()
        outs, calls = _calls(fn, k)
        side.sync(_last(outs))
        device.append(max((time.perf_counter() - t0) * 1e3 - busy, 0.0) / k)
        stream += calls[1:]  # the first call of the burst is a cold one (blocked_ms's)

        blocked.append(blocked_ms(fn, side))
    return {
        "first_call_ms": first_ms,
        "device_ms": statistics.median(device),
        "blocked_ms": statistics.median(blocked),
        "stream_ms": statistics.median(stream),
        "forwards_per_sample": k,
    }


def _calls(fn: Callable[[], Any], k: int) -> tuple[list[Any], list[float]]:
    """k back-to-back calls: their outputs and the host ms each took to return."""
    outs, ms = [], []
    for _ in range(k):
        t0 = time.perf_counter()
        outs.append(fn())
        ms.append((time.perf_counter() - t0) * 1e3)
    return outs, ms


def _noop(n: int) -> Callable[[], Any]:
    """A do-nothing jit call with `n` small array arguments, compiled."""
    import jax
    import jax.numpy as jnp

    args = [jnp.zeros((8,), jnp.float32) + i for i in range(n)]
    noop = jax.jit(lambda *a: a[0][:1])
    jax.block_until_ready(noop(*args))
    return functools.partial(noop, *args)


def stream_ms(fn: Callable[[], Any], side: _Side, repeat: int = 5, k: int = 12) -> float:
    """Stream host time per call of `fn`: calls 2..k of k back-to-back calls behind queued
    work, median over `repeat` bursts."""
    samples: list[float] = []
    for _ in range(repeat):
        side.sync()
        side.spin()
        outs, ms = _calls(fn, k)
        side.sync(_last(outs))
        samples += ms[1:]
    return statistics.median(samples)


def stream_floor_ms(side: _Side, n: int) -> float:
    """`stream_ms` of a do-nothing jit with `n` arguments."""
    return stream_ms(_noop(n), side)


def dispatch_floor_ms(side: _Side, counts: tuple[int, ...] = (1, 3, 6, 64), repeat: int = 11):
    """Host time for a do-nothing jit with n small arguments to return behind queued work.

    The floor a path's host time per call is compared with: what the runtime client charges
    for one dispatch with that many arguments, measured in the same process.
    """
    floors = {}
    for n in counts:
        call = _noop(n)
        samples = [blocked_ms(call, side) for _ in range(repeat)]
        floors[n] = statistics.median(samples)
    return floors


def same_args_floor(
    case: Any, side: _Side, floors: dict[int, float], stream: dict[int, float] | None = None
) -> dict[str, Any]:
    """`{"jit_args": n, "floor_same_args_ms": ms}` of a `BenchCase`: its main program's jit
    argument count and the host time of a do-nothing jit with that many arguments.

    `floors` (argument count -> ms, from `dispatch_floor_ms`) is reused and extended, so each
    count is measured once per run. Both are None when the count cannot be taken. With a
    `stream` dict (argument count -> ms, reused the same way) the do-nothing jit's stream host
    time is added as "floor_stream_ms".
    """
    try:
        n = case.jit_args() if case.jit_args is not None else main_program_args(case.jax_fn)
    except Exception:  # a closure that cannot be traced: no count rather than a failed row
        n = None
    if n is None:
        out = {"jit_args": None, "floor_same_args_ms": None}
        return out if stream is None else {**out, "floor_stream_ms": None}
    if n not in floors:
        floors.update(dispatch_floor_ms(side, (n,)))
    out = {"jit_args": n, "floor_same_args_ms": floors[n]}
    if stream is not None:
        if n not in stream:
            stream[n] = stream_floor_ms(side, n)
        out["floor_stream_ms"] = stream[n]
    return out


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """Dense bf16 matmul rate of an `n`-cube product on the default device, measured now: the
    ceiling a matmul-bound forward's TFLOP/s is compared with."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    product = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(product(a, b))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready([product(a, b) for _ in range(reps)])
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * n**3 / best / 1e12


def copy_ceiling_gbps(framework: str, nbytes: int = 1 << 30, mesh: Any = None) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured now.

    With a JAX `mesh`, every device of it copies `nbytes` at once and the result is per device.
    """
    if framework == "jax":
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        if mesh is None:
            x = jnp.ones((nbytes // 2,), jnp.bfloat16)
        else:
            shard = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
            x = jax.device_put(jnp.ones((mesh.size, nbytes // 2), jnp.bfloat16), shard)
        copy = jax.jit(lambda a: a + jnp.bfloat16(0))  # a full read + write pass
        jax.block_until_ready(copy(x))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready([copy(x) for _ in range(5)])
            times.append((time.perf_counter() - t0) / 5)
        return 2 * nbytes / min(times) / 1e9
    import torch

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / 5)
    return 2 * nbytes / min(times) / 1e9
