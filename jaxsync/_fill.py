"""Large host copies and checks split over a small thread pool.

numpy releases the GIL while it copies and reduces, so a batch of several megabytes checked
and copied in slices on a few threads moves at memory bandwidth instead of one core's rate.
The pinned DMA that follows a padding copy runs several times faster than one core copies,
so on the host side of a large upload the copy, not the transfer, sets the pace. A copy that
must also refuse NaN and inf checks each block right after writing it, while it is still in
cache, instead of reading the whole batch a second time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np


_MIN_BYTES = 4 << 20  # below this, handing slices to the pool costs more than it saves
_BLOCK_BYTES = 256 << 10  # a checked copy's block: fits a core's L2 cache
_WORKERS = max(1, min(8, (os.cpu_count() or 1) // 2))


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="jaxsync-fill")


def _map(tasks: Sequence[Callable[[], bool]]) -> list[bool]:
    """Runs `tasks` (on the pool when there are several), in order of their results."""
    if len(tasks) == 1:
        return [tasks[0]()]
    return list(_pool().map(lambda task: task(), tasks))


def _run(tasks: Sequence[Callable[[], bool]]) -> bool:
    """Runs `tasks` and ANDs their results."""
    return all(_map(tasks))


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


def _copy(d: np.ndarray, s: np.ndarray, lo: int, hi: int, check: bool) -> bool:
    """`d[lo:hi] = s[lo:hi]` along the leading axis. With `check`, block by block, each block
    checked for NaN and inf right after it is written, while it is still in the core's cache:
    one pass over memory instead of a check pass and a copy pass. False at the first bad block.
    """
    if not check:
        d[lo:hi] = s[lo:hi]
        return True
    step = max(1, _BLOCK_BYTES // max(1, d[:1].nbytes))
    with np.errstate(over="ignore"):  # a value that overflows the cast is reported as inf
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            d[a:b] = s[a:b]
            if not _finite(d[a:b]):
                return False
    return True


def copy_into(dst: np.ndarray, src: np.ndarray, *, check_finite: bool = False) -> bool:
    """`dst[...] = src` (same shape, numpy's casting), in slices on the pool when large.

    Contiguous arrays are split flat; a strided destination (the data corner of a padded
    buffer) is split along its first axis long enough to give every worker a part. With
    `check_finite`, returns whether every written float value is finite (checked as written,
    after the cast: a float64 value too large for a float32 buffer counts as inf); otherwise
    True. On False, `dst` may be partly written.
    """
    src = np.asarray(src)
    check = check_finite and _inexact(dst.dtype)
    d, s = _flat(dst), _flat(src)
    if d is not None and s is not None and d.size == s.size:
        parts = [(d, s, lo, hi) for lo, hi in _spans(d.size, dst.nbytes)]
    elif dst.shape == src.shape and dst.ndim:
        axis = next((a for a, n in enumerate(dst.shape) if n >= _WORKERS), 0)
        d, s = np.moveaxis(dst, axis, 0), np.moveaxis(src, axis, 0)  # views: no copy
        parts = [(d, s, lo, hi) for lo, hi in _spans(d.shape[0], dst.nbytes)]
    else:
        dst[...] = src
        return not check or all_finite(dst)
    return _run([lambda p=p: _copy(*p, check) for p in parts])


def fill_padded(out: np.ndarray, data: np.ndarray, *, check_finite: bool = False) -> bool:
    """Writes `data` at the leading corner of `out` and zeros the rest, each element once.

    Returns False when `check_finite` and a written float value is NaN or inf (see
    `copy_into`), else True."""
    corner: tuple[slice, ...] = ()
    for n in data.shape:
        out[(*corner, slice(n, None))] = 0
        corner = (*corner, slice(0, n))
    return copy_into(out[corner], data, check_finite=check_finite)


def fill_rows(
    out: np.ndarray, src: Any, lengths: Sequence[int], *, check_finite: bool = False
) -> list[int]:
    """`out[i, :n_i] = src[i][:n_i]`, zeros after each length and in rows past `src`.

    `src` is a `[B, W, ...]` array or a sequence of rows whose leading axis is their length
    (1-D waveforms, `[S_i, F]` feature clips). A large batch is copied in spans of
    about equal size on the pool (a long single row too). With `check_finite`, each row's
    copied samples are checked for NaN and inf as they are written (after the cast to
    `out`'s dtype); the rows that hold one are returned (empty: all finite). Samples past a
    row's length are never read.
    """
    lens = [int(n) for n in lengths]
    out[len(lens) :] = 0
    check = check_finite and _inexact(out.dtype)
    total = sum(lens)
    per = max(total, 1) if out.nbytes < _MIN_BYTES else max(1, -(-total // _WORKERS))
    # (row, lo, hi) spans; an empty row gets one empty span, so its tail is still zeroed.
    spans = [
        (i, lo, min(n, lo + per)) for i, n in enumerate(lens) for lo in range(0, max(n, 1), per)
    ]

    def span(i: int, lo: int, hi: int) -> bool:
        ok = _copy(out[i], src[i], lo, hi, check)
        if hi == lens[i]:
            out[i, hi:] = 0
        return ok

    tasks = [lambda t=t: span(*t) for t in spans]
    done = [task() for task in tasks] if out.nbytes < _MIN_BYTES else _map(tasks)
    return sorted({t[0] for t, ok in zip(spans, done, strict=True) if not ok})
