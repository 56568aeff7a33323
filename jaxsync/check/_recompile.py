"""Recompile proof: nothing is traced, lowered or compiled inside a `no_recompile()` region."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import chex
from jax import monitoring


_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"


class RecompileError(AssertionError):
    """Something was traced or compiled inside a `no_recompile()` region."""


@dataclasses.dataclass
class CompileLog:
    """What was traced / lowered / compiled during a region (process-wide, like JAX's cache).

    Attributes:
      traces: names of functions traced.
      lowerings: names of functions lowered to MLIR.
      compiles: names of functions compiled by the backend.
    """

    traces: list[str] = dataclasses.field(default_factory=list)
    lowerings: list[str] = dataclasses.field(default_factory=list)
    compiles: list[str] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.traces) + len(self.lowerings) + len(self.compiles)

    def __str__(self) -> str:
        return (
            f"{len(self.traces)} trace(s) {self.traces[:5]}, "
            f"{len(self.compiles)} compile(s) {self.compiles[:5]}"
        )


_lock = threading.Lock()
_active: list[CompileLog] = []
_listening = False


def _on_event(event: str, duration: float, **kwargs) -> None:
    if not _active:
        return
    name = str(kwargs.get("fun_name", "?"))
    with _lock:
        for log in _active:
            if event == _TRACE:
                log.traces.append(name)
            elif event == _LOWER:
                log.lowerings.append(name)
            elif event == _COMPILE:
                log.compiles.append(name)


def _listen() -> None:
    global _listening
    with _lock:
        if not _listening:
            monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileLog]:
    """Records traces, lowerings and compiles made (by any thread) while the region is open."""
    _listen()
    log = CompileLog()
    with _lock:
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)


@contextlib.contextmanager
def no_recompile(*, immediate: bool = False) -> Iterator[CompileLog]:
    """Raises `RecompileError` if anything is traced or compiled inside the region.

    Args:
      immediate: also make every backend compile raise at once, at its call site
        (`chex.restrict_backends(allowed=[])`), instead of at the end of the region.

    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda x: x + 1)
    >>> a, b, c = jnp.ones(3), jnp.zeros(3), jnp.ones(4)
    >>> _ = f(a)                         # warm up
    >>> with no_recompile():
    ...     _ = f(b)                     # same shape: cached
    ...     _ = f(c)                     # new shape: retrace
    Traceback (most recent call last):
    ...
    jaxsync.check._recompile.RecompileError: ...
    """
    with count_compiles() as log:
        if immediate:
            with chex.restrict_backends(allowed=[]):
                yield log
        else:
            yield log
    if log.count:
        raise RecompileError(f"recompiled inside no_recompile(): {log}")
