"""What one call of a benchmarked closure dispatches: XLA programs, torch kernels, and the jit
arguments of its main program (traced, never run)."""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any


def torch_kernels_per_call(fn: Callable[[], Any]) -> int | None:
    """Number of device kernels one call of a torch closure launches (torch profiler)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# Profiler event names of one XLA program execution. PjRt clients name them differently, and
# some nest several per execution: XLA:CPU (jax 0.10.2) emits one, jax 0.11.2's CUDA plugin on an
# H200 emitted three, two of them at the same "Execute" level (the C API wrapper and the client).
_EXECUTE_EVENT = re.compile(r"LoadedExecutable::Execute(Sharded|Helper|HelperOnSingleDevice)?$")


def jax_executions_per_call(fn: Callable[[], Any]) -> int | None:
    """XLA programs one call of a JAX closure executes, counted from a profiler trace.

    None when the backend's trace names no executions (an unknown PjRt client): a count the
    trace cannot support is not reported as zero.
    """
    import gzip
    import json
    import tempfile
    from pathlib import Path

    import jax

    jax.block_until_ready(fn())  # compiled and warm: the trace shows executions only
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(fn())
        files = list(Path(tmp).rglob("*perfetto_trace.json.gz"))
        if not files:
            return None
        trace = json.loads(gzip.open(files[0]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return count_executions(events)


def count_executions(events: list[dict]) -> int | None:
    """Program executions in profiler trace events: every execution emits each of its client's
    execute events once, so the count is the fewest events of any one execute-event name (None
    when there are none). Assumes the call's programs share one client path (all single-device
    or all sharded); a mix would be undercounted."""
    names = collections.Counter(
        e["name"] for e in events if e.get("ph") == "X" and _EXECUTE_EVENT.search(e.get("name", ""))
    )
    return min(names.values(), default=None)


def _size(jaxpr: Any) -> int:
    """Equations of a jaxpr, nested ones (scan bodies, inner jits) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    total += _size(sub)
    return total


def main_program_args(fn: Callable[[], Any]) -> int | None:
    """Jit arguments of the main program one call of a JAX closure dispatches.

    The closure is traced once (`jax.make_jaxpr`: nothing runs); every program it dispatches is
    one jit equation whose inputs are that program's flattened arguments. The main program is
    the one with the most work (equations, nested ones included). None when the call
    dispatches no program.
    """
    import jax

    jits = [
        eqn
        for eqn in jax.make_jaxpr(fn)().jaxpr.eqns
        if eqn.primitive.name in ("pjit", "jit") and "jaxpr" in eqn.params
    ]
    if not jits:
        return None
    main = max(jits, key=lambda eqn: _size(eqn.params["jaxpr"]))
    return len(main.invars)
