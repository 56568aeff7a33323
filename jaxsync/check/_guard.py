"""Runtime proof: a thread-local guard that turns device->host reads into errors or warnings.

Two layers, both armed by `sync_guard` for the current thread only:

1. JAX's own transfer guards (`disallow` host->device and device->host implicit transfers). They are
   thread-local. On GPU/TPU the device->host guard catches every implicit read, including the ones
   NumPy makes through the buffer protocol. On CPU JAX never guards reads (a CPU buffer is host
   memory), so:
2. Python-level interception, installed once and inert outside a guarded thread: `jax.Array`
   conversions (`int`, `float`, `bool`, `complex`, `operator.index`, `.item()`, `.tolist()`,
   `__array__`, `_value`, `repr`/`str`/`format`, `copy_to_host_async`, `block_until_ready`),
   `jax.device_get`, `jax.block_until_ready`, and the NumPy entry points `np.asarray`, `np.array`,
   `np.asanyarray`, `np.ascontiguousarray` when given a `jax.Array` (or a list/tuple holding one).

What the CPU backend cannot intercept: NumPy reads that reach a CPU `jax.Array` through the C
buffer protocol without passing a patched Python function, e.g. `memoryview(x)`, `np.float32(x)`,
ufuncs such as `np.add(x, 1)`, or C extensions reading the buffer. On GPU/TPU these are device->host
transfers and JAX's guard (layer 1) raises on them, so the GPU run (`tools/gpu_check.sh`) completes
the proof.

Guards are per thread (vLLM #51455 fixed the process-global version): arming one thread leaves
others alone, and `allow_sync()` only opens the current thread.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import jax
import numpy as np
from jax._src.core import Tracer


Mode = Literal["error", "warn"]
ENV_VAR = "JAXSYNC_SYNC_CHECK"


class SyncError(RuntimeError):
    """A device->host read or host wait happened inside a guarded region."""


class SyncWarning(RuntimeWarning):
    """Like SyncError, in "warn" mode."""


class _State(threading.local):
    def __init__(self) -> None:
        self.mode: Mode | None = None
        self.allow_depth = 0
        self.busy = 0  # > 0 while a patched call runs: nested patched calls do not re-report


_tls = _State()
_install_lock = threading.Lock()
_installed = False


def _armed() -> bool:
    return _tls.mode is not None and _tls.allow_depth == 0 and _tls.busy == 0


def _report(what: str) -> None:
    msg = (
        f"host sync inside a jaxsync sync_guard: {what}. Device data must not be read back on a "
        "sync-free path; wrap a deliberate sync in jaxsync.check.allow_sync()."
    )
    if _tls.mode == "error":
        raise SyncError(msg)
    warnings.warn(msg, SyncWarning, stacklevel=4)


def _guarded(what: str, orig: Callable[..., Any], test: Callable[..., bool] | None = None):
    def wrapper(*args, **kwargs):
        if _armed() and (test is None or test(*args, **kwargs)):
            _report(what)
        _tls.busy += 1
        try:
            return orig(*args, **kwargs)
        finally:
            _tls.busy -= 1

    # functools.wraps fails on some nanobind methods (non-string __qualname__): copy by hand.
    wrapper.__name__ = str(getattr(orig, "__name__", what))
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__jaxsync_original__ = orig
    return wrapper


def _holds_device_array(obj: Any = None, *args: Any, **kwargs: Any) -> bool:
    if isinstance(obj, jax.Array):
        return not isinstance(obj, Tracer)
    if isinstance(obj, list | tuple):
        return any(isinstance(o, jax.Array) and not isinstance(o, Tracer) for o in obj)
    return False


_ARRAY_READS = (
    "__int__", "__float__", "__complex__", "__bool__", "__index__", "item", "tolist",
    "__array__", "__repr__", "__str__", "__format__", "copy_to_host_async", "block_until_ready",
)  # fmt: skip
_NUMPY_READS = ("asarray", "array", "asanyarray", "ascontiguousarray")


def install() -> None:
    """Installs the Python-level interceptors (idempotent; inert outside guarded threads)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from jax._src import array as jax_array

        impl = jax_array.ArrayImpl
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
    """Disallows device->host reads and implicit host->device transfers in this thread.

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
    prev = (_tls.mode, _tls.allow_depth)
    _tls.mode, _tls.allow_depth = mode, 0
    try:
        with jax.transfer_guard_device_to_host(level), jax.transfer_guard_host_to_device(level):
            yield
    finally:
        _tls.mode, _tls.allow_depth = prev


@contextlib.contextmanager
def allow_sync() -> Iterator[None]:
    """Opens the current thread's guard for a deliberate sync.

    >>> import jax.numpy as jnp
    >>> with sync_guard():
    ...     with allow_sync():
    ...         int(jnp.ones(()))
    1
    """
    _tls.allow_depth += 1
    try:
        with jax.transfer_guard("allow"):
            yield
    finally:
        _tls.allow_depth -= 1


def guard_active() -> bool:
    """True when the current thread is inside a `sync_guard` (and not inside `allow_sync`)."""
    return _tls.mode is not None and _tls.allow_depth == 0


def _raw_env() -> Any:
    """JAXSYNC_SYNC_CHECK's raw value, or None when unset.

    Every entry point reads it per call, so this is on the hot path. `os.environ.get` runs
    Python-level key encoding and value decoding: about 25 us for one cold call on the CPU CI
    machine, most of a cold entry point's overhead. CPython's `os.environ` keeps its data in a
    plain dict (`_data`, keyed by `encodekey(name)`, updated in place by every change to
    `os.environ`), where one lookup is a C call; anything else falls back to `os.environ.get`.
    """
    if _ENV_DATA is not None:
        return _ENV_DATA.get(_ENV_KEY)
    return os.environ.get(ENV_VAR)


try:
    _ENV_KEY: Any = os.environ.encodekey(ENV_VAR)  # type: ignore[attr-defined]
    _ENV_DATA: dict | None = os.environ._data  # type: ignore[attr-defined]
    if not isinstance(_ENV_DATA, dict):
        raise AttributeError
except AttributeError:  # not CPython's os._Environ: `_raw_env` uses os.environ.get
    _ENV_KEY, _ENV_DATA = ENV_VAR, None
_MODES: dict[Any, Mode | None] = {}  # raw value -> parsed mode (a handful of distinct values)


def env_mode() -> Mode | None:
    """The mode set by JAXSYNC_SYNC_CHECK (off/unset -> None, warn, error)."""
    raw = _raw_env()
    if raw is None:
        return None
    if raw in _MODES:
        return _MODES[raw]
    text = (os.fsdecode(raw) if isinstance(raw, bytes) else raw).strip().lower()
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

    An already guarded thread is not re-armed, so entry points may call each other.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # Unset (the serving default) costs one C dict lookup: a cold call pays per Python frame.
        if _ENV_DATA is not None and _ENV_KEY not in _ENV_DATA:
            return fn(*args, **kwargs)
        mode = env_mode()
        if mode is None or _tls.mode is not None:
            return fn(*args, **kwargs)
        with sync_guard(mode):
            return fn(*args, **kwargs)

    wrapper.__jaxsync_entry_point__ = True
    return wrapper
