"""Large host copies and checks split over a small thread pool.

numpy releases the GIL while it copies and reduces, so a batch of several megabytes checked
and copied in slices on a few threads moves at memory bandwidth instead of one core's rate.
The pinned DMA that follows a padding copy runs several times faster than one core copies,
so on the host side of a large upload the copy, not the transfer, sets the pace.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np


_MIN_BYTES = 4 << 20  # below this, handing slices to the pool costs more than it saves
_WORKERS = max(1, min(8, (os.cpu_count() or 1) // 2))


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="jaxsync-fill")


def _run(tasks: Sequence[Callable[[], bool]]) -> bool:
    """Runs `tasks` (on the pool when there are several) and ANDs their results."""
    if len(tasks) == 1:
        return tasks[0]()
    return all(list(_pool().map(lambda task: task(), tasks)))


def _flat(x: np.ndarray) -> np.ndarray | None:
    return x.reshape(-1) if x.flags.c_contiguous else None


def _spans(n: int, nbytes: int) -> list[tuple[int, int]]:
    """`[lo, hi)` ranges of n items, one per worker for a large array, else one range."""
    parts = 1 if nbytes < _MIN_BYTES else min(_WORKERS, n)
    edges = np.linspace(0, n, parts + 1).astype(int).tolist()
    return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True) if hi > lo]


def _finite(x: np.ndarray) -> bool:
    if not x.size:
        return True
    if x.dtype.kind != "f":  # bfloat16 and float8 (ml_dtypes): numpy's own floats only below
        return bool(np.isfinite(x).all())
    # A sum propagates NaN and +-inf, so a finite sum proves every value finite in one pass.
    # A non-finite sum may be finite values overflowing (float16 does so easily, hence only
    # float32/64 try it): min and max then decide exactly, with no temporary array.
    if x.dtype in _SUMMED:
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(x.sum()):
                return True
    return bool(np.isfinite(x.min()) and np.isfinite(x.max()))


_SUMMED = (np.dtype(np.float32), np.dtype(np.float64))


@functools.cache  # a handful of dtypes; JAX's lattice walk costs microseconds per call
def _inexact(dtype: np.dtype) -> bool:
    # ml_dtypes' floats (bfloat16, float8) are not numpy.floating subtypes: numpy alone would
    # call them not floating and skip their check. JAX's dtype lattice knows them.
    return bool(jnp.issubdtype(dtype, jnp.floating))


def all_finite(arr: np.ndarray) -> bool:
    """Whether a host float array (numpy's floats, bfloat16, float8) holds no NaN or inf (other
    dtypes: True)."""
    if not arr.size or not _inexact(arr.dtype):
        return True
    flat = _flat(arr)
    if flat is None:
        return bool(np.isfinite(arr).all())
    return _run(
        [lambda lo=lo, hi=hi: _finite(flat[lo:hi]) for lo, hi in _spans(flat.size, arr.nbytes)]
    )


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` (same shape, numpy's casting), in slices on the pool when large.

    Contiguous arrays are split flat; a strided destination (the data corner of a padded
    buffer) is split along its first axis long enough to give every worker a part."""
    src = np.asarray(src)
    d, s = _flat(dst), _flat(src)
    if d is not None and s is not None and d.size == s.size:
        parts = [(d, s, lo, hi) for lo, hi in _spans(d.size, dst.nbytes)]
    elif dst.shape == src.shape and dst.ndim:
        axis = next((a for a, n in enumerate(dst.shape) if n >= _WORKERS), 0)
        d, s = np.moveaxis(dst, axis, 0), np.moveaxis(src, axis, 0)  # views: no copy
        parts = [(d, s, lo, hi) for lo, hi in _spans(d.shape[0], dst.nbytes)]
    else:
        dst[...] = src
        return

    def part(d: np.ndarray, s: np.ndarray, lo: int, hi: int) -> bool:
        d[lo:hi] = s[lo:hi]
        return True

    _run([lambda p=p: part(*p) for p in parts])


def fill_padded(out: np.ndarray, data: np.ndarray) -> None:
    """Writes `data` at the leading corner of `out` and zeros the rest, each element once."""
    corner: tuple[slice, ...] = ()
    for n in data.shape:
        out[(*corner, slice(n, None))] = 0
        corner = (*corner, slice(0, n))
    copy_into(out[corner], data)


def fill_rows(out: np.ndarray, src: np.ndarray, lengths: Sequence[int]) -> None:
    """`out[i, :n_i] = src[i, :n_i]`, zeros after each length and in rows past `src`; rows in
    parallel when large. Values are not checked here: check them before (`all_finite`)."""
    rows = len(lengths)
    out[rows:] = 0

    def row(i: int) -> None:
        n = int(lengths[i])
        out[i, :n] = src[i, :n]
        out[i, n:] = 0

    if out.nbytes < _MIN_BYTES or rows == 1:
        for i in range(rows):
            row(i)
    else:
        list(_pool().map(row, range(rows)))
