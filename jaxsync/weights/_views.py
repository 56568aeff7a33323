"""A rule's layout transform applied as numpy views and written once into the parameter's buffer.

Layout transforms only move elements: `linear`, `conv`, `transpose`, and reshape-transpose-reshape
reorders (GLM-4.1V's head-major qkv, gemma3n's GLU pairs). Traced once per transform and stored
shape (`jax.make_jaxpr`), a transform whose program is a chain of `reshape`s and `transpose`s is
replayed on the stored tensor as numpy views. A reshape that cannot be a view (the one closing a
reorder) is applied to the destination instead: a C-contiguous buffer takes any shape of its
size as a view, so the tensor is copied once, straight into its place. The copy runs in tiles
that keep the strided side in cache, and casts in the same pass. Any other transform runs as
written and its result is copied.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


Op = tuple[str, tuple[int, ...]]  # ("reshape", sizes) or ("transpose", permutation)

_TILE_A = 1024  # elements along the source's contiguous axis per tile
_TILE_B = 32  # elements along the destination's contiguous axis per tile
_ALIASED_TILE_B = 16  # the same, where source rows 4 KiB apart share a cache set
_TILED_BYTES = 1 << 18  # smaller copies stay in cache whatever their order
_MAX_LOOPED = 4096  # positions of the other axes, each a tile loop of its own (else kept whole)
_MIN_RUN = 16  # the axes tiled: the innermost ones (source, destination) of at least this size


def view_chain(transform: Callable | None, shape: tuple[int, ...], dtype: Any):
    """The transform as a chain of `Op`s on a tensor of `shape` and `dtype` (`()` for no
    transform), or None when it is anything else (arithmetic, a gather, a cast)."""
    if transform is None:
        return ()
    try:
        hash(transform)
    except TypeError:
        return _trace(transform, shape, dtype)
    return _traced(transform, shape, np.dtype(dtype))


@functools.lru_cache(maxsize=1024)
def _traced(transform: Callable, shape: tuple[int, ...], dtype: np.dtype):
    return _trace(transform, shape, dtype)


def _trace(transform: Callable, shape: tuple[int, ...], dtype: Any) -> tuple[Op, ...] | None:
    try:
        closed = jax.make_jaxpr(transform)(jax.ShapeDtypeStruct(shape, dtype))
    except Exception:  # the shape checks already traced it; anything else is not a chain
        return None
    jaxpr = closed.jaxpr
    if len(jaxpr.invars) != 1 or len(jaxpr.outvars) != 1 or jaxpr.constvars:
        return None
    ops: list[Op] = []
    current = jaxpr.invars[0]
    for eqn in jaxpr.eqns:
        if len(eqn.invars) != 1 or eqn.invars[0] is not current or len(eqn.outvars) != 1:
            return None
        name = eqn.primitive.name
        if name == "reshape" and eqn.params.get("dimensions") is None:
            ops.append(("reshape", tuple(int(n) for n in eqn.params["new_sizes"])))
        elif name == "transpose":
            ops.append(("transpose", tuple(int(a) for a in eqn.params["permutation"])))
        else:
            return None
        current = eqn.outvars[0]
    if jaxpr.outvars[0] is not current:
        return None
    return tuple(ops)


def write(dst: np.ndarray, raw: np.ndarray, ops: tuple[Op, ...]) -> None:
    """`dst[...] = chain(raw)`, cast to `dst`'s dtype (one copy where `dst` is C-contiguous)."""
    view = raw
    for i, (kind, arg) in enumerate(ops):
        if kind == "transpose":
            view = view.transpose(arg)
            continue
        reshaped = _reshaped_view(view, arg)
        if reshaped is None and i == len(ops) - 1:  # the closing reshape: dst takes its input
            target = _reshaped_view(dst, view.shape)
            if target is not None:
                copy_tiled(target, view)
                return
        view = view.reshape(arg) if reshaped is None else reshaped
    copy_tiled(dst, view)


def _reshaped_view(view: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """`view.reshape(shape)` when it is a view, else None."""
    try:
        return np.reshape(view, shape, copy=False)
    except ValueError:  # a copy would be needed
        return None
    except TypeError:  # numpy < 2.1 has no `copy=`
        out = view.view()
        try:
            out.shape = shape
        except AttributeError:
            return None
        return out


def copy_tiled(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` (cast as `ndarray.astype` casts): when `src` is strided against `dst`'s
    layout (a transpose), tile by tile over the source's contiguous axis and the destination's,
    at each position of the other axes, so that both sides of each tile stay in cache. A large
    copy without a cast is split over a few threads (numpy copies without the GIL)."""
    moved = src.dtype == dst.dtype
    if moved:  # moved as plain unsigned integers: numpy's fastest loops
        unsigned = np.dtype(f"u{src.dtype.itemsize}")
        src, dst = src.view(unsigned), dst.view(unsigned)
    wide = [a for a in range(src.ndim) if src.shape[a] >= _MIN_RUN]
    if src.nbytes < _TILED_BYTES or len(wide) < 2:
        np.copyto(dst, src, casting="unsafe")
        return
    near = min(wide, key=lambda a: abs(src.strides[a]))  # the source's contiguous axis
    inner = min((a for a in wide if a != near), key=lambda a: abs(dst.strides[a]))  # dst's
    if abs(src.strides[near]) >= abs(src.strides[inner]):
        np.copyto(dst, src, casting="unsafe")  # not strided against it: one pass is in order
        return
    rest = [a for a in range(src.ndim) if src.shape[a] > 1 and a not in (near, inner)]
    looped = rest if math.prod(src.shape[a] for a in rest) <= _MAX_LOOPED else []
    rows = _ALIASED_TILE_B if abs(src.strides[inner]) % 4096 == 0 else _TILE_B

    def tiles(lo: int, hi: int) -> None:
        index: list[Any] = [slice(None)] * src.ndim
        for at in itertools.product(*(range(src.shape[a]) for a in looped)):
            for a, i in zip(looped, at, strict=True):
                index[a] = i
            for i in range(lo, hi, _TILE_A):
                index[near] = slice(i, min(i + _TILE_A, hi))
                for j in range(0, src.shape[inner], rows):
                    index[inner] = slice(j, j + rows)
                    np.copyto(dst[tuple(index)], src[tuple(index)], casting="unsafe")

    n = src.shape[near]
    parts = min(_WORKERS, -(-n // _TILE_A)) if moved and src.nbytes >= _THREADED_BYTES else 1
    if parts <= 1:
        tiles(0, n)
        return
    step = -(-n // parts // _TILE_A) * _TILE_A  # whole tiles per thread
    list(_pool().map(lambda lo: tiles(lo, min(lo + step, n)), range(0, n, step)))


_WORKERS = max(1, min(8, os.cpu_count() or 1))
_THREADED_BYTES = 4 << 20  # smaller copies cost less than handing them to the threads


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="jaxsync-load")
