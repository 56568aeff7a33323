"""Host inputs: what every entry point accepts, and the checks that cost no device sync.

Servers hand over processor outputs as numpy arrays, lists or torch CPU tensors. These helpers
turn them into numpy without importing torch, and refuse what would give a wrong answer that
looks right (floats or bools where ids are expected, ragged lists, non-finite pixels), before
any upload or compile.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync._fill import all_finite


def is_torch_tensor(x: Any) -> bool:
    """A torch tensor, detected without importing torch."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _from_torch(x: Any, name: str) -> np.ndarray:
    if x.device.type != "cpu":
        raise TypeError(f"{name} is a torch tensor on {x.device}: pass host data (a CPU tensor)")
    x = x.detach()
    if str(x.dtype) == "torch.bfloat16":  # numpy has no bfloat16: widen exactly
        x = x.float()
    return x.numpy()


def host_array(x: Any, *, name: str, dtype: Any = None, ndim: int | None = None) -> np.ndarray:
    """`x` (numpy, list, tuple, torch CPU tensor) as a numpy array, validated.

    Raises:
      TypeError: device data (a jax array or a torch tensor off the CPU) where host data is
        required, or a value numpy would store as objects.
      ValueError: a ragged nested list, or the wrong rank.
    """
    if isinstance(x, jax.Array):
        raise TypeError(
            f"{name} must be host data (numpy, list, torch CPU tensor), got a jax array"
        )
    if is_torch_tensor(x):
        arr = _from_torch(x, name)
    else:
        try:
            arr = np.asarray(x)
        except ValueError as e:  # numpy's "inhomogeneous shape"
            raise ValueError(f"{name} is ragged (rows of different lengths): {e}") from None
    if arr.dtype == object:
        raise TypeError(f"{name} must be numeric, got values numpy stores as objects")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {arr.shape}")
    return arr if dtype is None else arr.astype(dtype, copy=False)


def host_ints(x: Any, *, name: str, ndim: int | None = 1, minimum: int | None = 0) -> np.ndarray:
    """Integer host metadata (ids, lengths, grids) as int64, refusing anything not an integer.

    Floats (even integral ones like 2.0) and bools are `TypeError`: truncating them would pick
    another block, length or image size without a word. Python lists are checked element by
    element, since numpy silently turns `[True, 5]` into `[1, 5]`.
    """
    if isinstance(x, list | tuple):
        _check_python_ints(x, name)
    arr = host_array(x, name=name, ndim=ndim)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        if arr.size or arr.dtype == np.bool_:
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if minimum is not None and arr.size and arr.min() < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {arr.min()}")
    return arr


def _check_python_ints(x: list | tuple, name: str) -> None:
    stack = [x]
    while stack:
        for v in stack.pop():
            if isinstance(v, list | tuple):
                stack.append(v)
            elif isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must hold integers, got {type(v).__name__} {v!r}")


def host_int(x: Any, *, name: str, minimum: int | None = None) -> int:
    """One integer setting (a block size, a token count); bools and floats are `TypeError`."""
    if isinstance(x, bool | np.bool_) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def check_finite(arr: np.ndarray, *, name: str) -> None:
    """Refuses host floats holding NaN or inf (one item's NaN must never reach the batch)."""
    if not all_finite(arr):
        raise non_finite_error(arr, name=name)


def non_finite_error(arr: np.ndarray, *, name: str, dtype: Any = None) -> ValueError:
    """The error for host floats `arr` found non-finite as they are (or once cast to `dtype`:
    a value beyond its range), naming the first bad index."""
    bad = np.argwhere(~np.isfinite(arr))
    if bad.size or dtype is None:
        where = f" (first at index {bad[0].tolist()})" if bad.size else ""
        return ValueError(f"{name} holds a non-finite value{where}")
    limit = float(jnp.finfo(dtype).max)
    big = np.argwhere(np.abs(arr.astype(np.float64)) > limit)
    where = f" (first at index {big[0].tolist()})" if big.size else ""
    return ValueError(f"{name} holds a value too large for {np.dtype(dtype).name}{where}")


def refuse_masked(x: Any, *, name: str) -> None:
    """Refuses a numpy masked array: every upload would drop its mask and send the hidden values.

    Raises:
      TypeError: `x` is a `np.ma.MaskedArray`.
    """
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a numpy masked array; an upload would drop the mask and send the masked "
            "values: fill them first (x.filled(value)) and pass a plain array"
        )


def upload_dtype(arr: np.ndarray, dtype: Any = None) -> np.dtype:
    """The dtype a device array of host data `arr` gets (`dtype` if given): with x64 off, JAX
    stores 64-bit integers and floats in 32 bits."""
    return np.dtype(jax.dtypes.canonicalize_dtype(arr.dtype if dtype is None else dtype))


def check_fits(arr: np.ndarray, target: Any, *, name: str) -> None:
    """Refuses host numbers that would change when stored as `target`, before any upload.

    Integers beyond an integer target's range (int64 into int32 wraps) and finite numbers beyond
    a float target's finite range (float64 1e300 into float32 becomes inf) are refused; values
    that fit, and NaN or inf already present, pass unchanged. Costs nothing when `target` holds
    every value of `arr`'s dtype.

    Raises:
      ValueError: a value does not fit, naming the first one's index.
    """
    src, target = arr.dtype, np.dtype(target)
    if not arr.size or src == target or src == np.bool_:
        return
    flat = arr.reshape(-1)
    if np.issubdtype(target, np.integer) and np.issubdtype(src, np.integer):
        lo, hi = np.iinfo(target).min, np.iinfo(target).max
        if np.iinfo(src).min >= lo and np.iinfo(src).max <= hi:
            return
        if flat.min() >= lo and flat.max() <= hi:
            return
        bad = (flat < lo) | (flat > hi)
    elif jnp.issubdtype(target, jnp.floating) and src.kind in "iuf":
        limit = float(jnp.finfo(target).max)
        widest = np.iinfo(src).max if np.issubdtype(src, np.integer) else jnp.finfo(src).max
        if float(widest) <= limit:
            return
        magnitude = np.abs(flat.astype(np.float64, copy=False))
        if not float(np.fmax.reduce(magnitude)) > limit:  # fmax skips NaN
            return
        bad = np.isfinite(magnitude) & (magnitude > limit)  # inf already present stays inf
    else:
        return
    found = np.flatnonzero(bad)
    if not found.size:
        return
    i = int(found[0])
    where = [int(j) for j in np.unravel_index(i, arr.shape)]
    x64_off = target == upload_dtype(arr)  # the narrowing is JAX's own, not a dtype asked for
    raise ValueError(
        f"{name} holds {flat[i].item()!r} (first at index {where}), which does not fit in "
        f"{target.name}, the dtype it would be stored as on the device"
        + (" (jax_enable_x64 is off)" if x64_off else "")
    )
