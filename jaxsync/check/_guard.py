"""Runtime proof: a guard that turns device->host reads into errors or warnings.

Two layers, both armed by `sync_guard`:

1. JAX's own transfer guards (`disallow` host->device and device->host implicit transfers). They are
   per thread. On GPU/TPU the device->host guard catches every implicit read, including the ones
   NumPy makes through the buffer protocol. On CPU JAX never guards reads (a CPU buffer is host
   memory), so:
2. Python-level interception, installed once and inert outside a guarded context: `jax.Array`
   conversions (`int`, `float`, `bool`, `complex`, `operator.index`, `.item()`, `.tolist()`,
   `__array__`, `_value`, `repr`/`str`/`format`, `copy_to_host_async`, `block_until_ready`),
   `jax.device_get`, `jax.block_until_ready`, and the NumPy entry points `np.asarray`, `np.array`,
   `np.asanyarray`, `np.ascontiguousarray` when given a `jax.Array` (or a list/tuple holding one).

What the CPU backend cannot intercept: NumPy reads that reach a CPU `jax.Array` through the C
buffer protocol without passing a patched Python function, e.g. `memoryview(x)`, `np.float32(x)`,
ufuncs such as `np.add(x, 1)`, or C extensions reading the buffer. On GPU/TPU these are device->host
transfers and JAX's guard (layer 1) raises on them, so the GPU run (`tools/gpu_check.sh`) completes
the proof.

The Python layer is per context (`contextvars`): arming one thread leaves other threads alone, and
arming one asyncio task leaves its siblings alone, even while it holds the guard across an
`await` (a task copies its creator's context when it is created, so a task created inside the
guard is guarded too). `allow_sync()` only opens the current context. JAX's layer is per thread:
on GPU/TPU a sibling task that runs while a guarded task waits at an `await` is under JAX's
transfer guard as well, so an implicit transfer there raises JAX's error. Tasks may leave their
guards in any order: the thread's JAX levels follow the most recently entered guard or
`allow_sync` still open, and return to what they were once none is (`_jax_guard`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import jax
import numpy as np

from jaxsync import _compat
from jaxsync.check._jax_guard import held


Mode = Literal["error", "warn"]
ENV_VAR = "JAXSYNC_SYNC_CHECK"


class SyncError(RuntimeError):
    """A device->host read or host wait happened inside a guarded region."""


class SyncWarning(RuntimeWarning):
    """Like SyncError, in "warn" mode."""


# (mode, allow_sync depth) of the current context; (None, 0) outside every guard.
_scope: contextvars.ContextVar[tuple[Mode | None, int]] = contextvars.ContextVar(
    "jaxsync_sync_guard", default=(None, 0)
)


class _Busy(threading.local):
    # > 0 while a patched call runs in this thread: nested patched calls do not re-report. Per
    # thread, not per context: a patched call never yields to another task in the middle.
    count = 0


_busy = _Busy()
_install_lock = threading.Lock()
_installed = False


def _armed() -> bool:
    mode, allow_depth = _scope.get()
    return mode is not None and allow_depth == 0 and _busy.count == 0


def _report(what: str) -> None:
    msg = (
        f"host sync inside a jaxsync sync_guard: {what}. Device data must not be read back on a "
        "sync-free path; wrap a deliberate sync in jaxsync.check.allow_sync()."
    )
    if _scope.get()[0] == "error":
        raise SyncError(msg)
    warnings.warn(msg, SyncWarning, stacklevel=4)


def _guarded(what: str, orig: Callable[..., Any], test: Callable[..., bool] | None = None):
    def wrapper(*args, **kwargs):
        if _armed() and (test is None or test(*args, **kwargs)):
            _report(what)
        _busy.count += 1
        try:
            return orig(*args, **kwargs)
        finally:
            _busy.count -= 1

    # functools.wraps fails on some nanobind methods (non-string __qualname__): copy by hand.
    wrapper.__name__ = str(getattr(orig, "__name__", what))
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__jaxsync_original__ = orig
    return wrapper


def _holds_device_array(obj: Any = None, *args: Any, **kwargs: Any) -> bool:
    if isinstance(obj, jax.Array):
        return not isinstance(obj, jax.core.Tracer)
    if isinstance(obj, list | tuple):
        return any(isinstance(o, jax.Array) and not isinstance(o, jax.core.Tracer) for o in obj)
    return False


_ARRAY_READS = (
    "__int__", "__float__", "__complex__", "__bool__", "__index__", "item", "tolist",
    "__array__", "__repr__", "__str__", "__format__", "copy_to_host_async", "block_until_ready",
)  # fmt: skip
_NUMPY_READS = ("asarray", "array", "asanyarray", "ascontiguousarray")


def install() -> None:
    """Installs the Python-level interceptors (idempotent; inert outside guarded contexts)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        impl = _compat.array_type()
        for name in _ARRAY_READS:
            orig = getattr(impl, name)
            setattr(impl, name, _guarded(f"jax.Array.{name}", orig))
        value_prop = impl._value
        impl._value = property(_guarded("jax.Array._value", value_prop.fget))
        for name in _NUMPY_READS:
            orig = getattr(np, name)
            setattr(np, name, _guarded(f"np.{name}(jax.Array)", orig, _holds_device_array))
        jax.device_get = _guarded("jax.device_get", jax.device_get)
        jax.block_until_ready = _guarded("jax.block_until_ready", jax.block_until_ready)
        _installed = True


@contextlib.contextmanager
def sync_guard(mode: Mode = "error") -> Iterator[None]:
    """Disallows device->host reads and implicit host->device transfers in this context.

    Args:
      mode: "error" raises `SyncError` (and JAX's transfer-guard error on GPU/TPU); "warn" emits a
        `SyncWarning` and lets the read happen.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(3)
    >>> with sync_guard():
    ...     y = (x + x).sum()  # dispatch only: fine
    ...     int(y)             # a read: raises
    Traceback (most recent call last):
    ...
    jaxsync.check._guard.SyncError: host sync inside a jaxsync sync_guard: jax.Array.__int__. ...
    """
    if mode not in ("error", "warn"):
        raise ValueError(f"mode must be 'error' or 'warn', got {mode!r}")
    install()
    level = "disallow" if mode == "error" else "log"
    prev = _scope.get()
    _scope.set((mode, 0))
    try:
        with held(h2d=level, d2h=level):  # restored correctly whatever order tasks exit in
            yield
    finally:
        _scope.set(prev)


@contextlib.contextmanager
def allow_sync() -> Iterator[None]:
    """Opens the current context's guard for a deliberate sync.

    >>> import jax.numpy as jnp
    >>> with sync_guard():
    ...     with allow_sync():
    ...         int(jnp.ones(()))
    1
    """
    prev = _scope.get()
    _scope.set((prev[0], prev[1] + 1))
    try:
        with held(h2d="allow", d2h="allow", d2d="allow"):
            yield
    finally:
        _scope.set(prev)


def guard_active() -> bool:
    """True when the current context is inside a `sync_guard` (and not inside `allow_sync`)."""
    mode, allow_depth = _scope.get()
    return mode is not None and allow_depth == 0


# Every entry call reads the variable. `os.environ.get` runs four Python frames; the mapping it
# wraps is one C lookup (kept in sync by `os.environ[...] = ...`, `putenv` and monkeypatch).
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = ENV_VAR if _ENVIRON is None else os.environ.encodekey(ENV_VAR)

# raw (encoded) value -> parsed mode: a handful of distinct values per process.
_MODES: dict[str | bytes, Mode | None] = {}


def env_mode() -> Mode | None:
    """The mode set by JAXSYNC_SYNC_CHECK (off/unset -> None, warn, error)."""
    raw = os.environ.get(ENV_VAR) if _ENVIRON is None else _ENVIRON.get(_ENV_KEY)
    if raw is None:
        return None
    if raw in _MODES:
        return _MODES[raw]
    text = raw if isinstance(raw, str) else os.environ.decodevalue(raw)
    text = text.strip().lower()
    if text in ("", "off", "0", "none"):
        mode = None
    elif text in ("warn", "error"):
        mode = cast(Mode, text)
    else:
        raise ValueError(f"{ENV_VAR} must be off, warn or error; got {text!r}")
    _MODES[raw] = mode
    return mode


def entry_point(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a path entry point: with JAXSYNC_SYNC_CHECK=warn|error it runs inside `sync_guard`.

    An already guarded context is not re-armed, so entry points may call each other.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _ENVIRON is not None and _ENV_KEY not in _ENVIRON:  # unset: no call to env_mode
            return fn(*args, **kwargs)
        mode = env_mode()
        if mode is None or _scope.get()[0] is not None:
            return fn(*args, **kwargs)
        with sync_guard(mode):
            return fn(*args, **kwargs)

    wrapper.__jaxsync_entry_point__ = True
    return wrapper
