"""Experimental Pallas kernel for device->device block copies (`copy_blocks(..., impl="pallas")`).

Why: XLA runs the block copy as a gather and a scatter, two passes over the copied bytes, and on
an H200 reached about half of a contiguous copy (see docs/benchmarks.md). This kernel copies each
block straight from the source cache into the donated destination in one pass. Grid
`(blocks, row_tiles)`: each program moves a `[1, tile_rows, cols]` slab of one layer's
`[P, rows, cols]` view. Padded entries carry out-of-range destination ids and are skipped.

Status (H200, jax 0.11.2, 2026-11-29). The first compiled runs "failed parity", but the failure
was a warning: the test suite turns warnings into errors, and Pallas warns on every GPU lowering
(first that `pallas_call` for Mosaic GPU is deprecated, then, once the kernel was pinned to
Triton, that Pallas' Triton backend is deprecated). `tools/diagnose_pallas.py` compared the
compiled Triton kernel with the XLA copy block by block on the H200: no block differs. Copies
now run with that one warning silenced (`quiet_triton_deprecation`).

The kernel is pinned to Triton (`pltriton.CompilerParams()`): it relies on un-blocked refs being
global-memory pointers, each program loading and storing one slab. Pallas' default GPU backend
since jax 0.10 (Mosaic GPU) stages un-blocked refs through shared memory instead. Pallas says it
will remove its Triton backend; a Mosaic GPU port (`plgpu.kernel`) is the follow-up.
"""

from __future__ import annotations

import contextlib
import functools as ft
import math
import warnings

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import jaxsync
from jaxsync.kv._layout import Cache


ALLOW_COMPILED = True
"""Compiled (non-interpret) use of the kernel; a switch to turn it off if a GPU misbehaves."""


@contextlib.contextmanager
def quiet_triton_deprecation():
    """Silences Pallas' "Triton backend is deprecated" warning (emitted at lowering) and only
    that one: a user running with warnings as errors would otherwise get an exception."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
        )
        yield


_TILE_ELEMENTS = 4096  # per program: 8 KiB of bf16, few registers per thread


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@ft.cache  # called per leaf on every GPU copy (impl="auto"): ~1 us uncached, 32+ leaves
def slab(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """`(rows, cols, tile_rows)` of a `[P, ...]` leaf viewed as `[P, rows, cols]`, or None when
    Triton's power-of-two block shapes cannot cover it."""
    cols = shape[-1]
    rows = math.prod(shape[1:-1]) if len(shape) > 2 else 1
    if not (_is_pow2(cols) and _is_pow2(rows)):
        return None
    tile = max(1, min(rows, _TILE_ELEMENTS // cols))
    return rows, cols, tile


def _kernel(src_ids, dst_ids, src, dst_in, out):
    del dst_in  # aliased to `out`: blocks not written keep their values
    i, r = pl.program_id(0), pl.program_id(1)
    tile = out.shape[1] // pl.num_programs(1)
    d = dst_ids[i]

    @pl.when(d < out.shape[0])  # padding entries point past the cache
    def _():
        s = src_ids[i]
        rows = pl.ds(r * tile, tile)
        out[pl.ds(d, 1), rows, :] = src[pl.ds(s, 1), rows, :]


def _copy_leaf(s: jax.Array, d: jax.Array, src_ids, dst_ids, interpret: bool) -> jax.Array:
    rows, cols, tile = slab(d.shape)
    s3 = s.reshape(s.shape[0], rows, cols)
    d3 = d.reshape(d.shape[0], rows, cols)
    out = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(d3.shape, d3.dtype),
        grid=(src_ids.shape[0], rows // tile),
        input_output_aliases={3: 0},
        interpret=interpret,
        # Triton, not the default Mosaic GPU: the kernel relies on un-blocked refs being pointers.
        compiler_params=None if interpret else pltriton.CompilerParams(),
    )(src_ids, dst_ids, s3, d3)
    return out.reshape(d.shape)


@ft.partial(jax.jit, donate_argnames="dst", static_argnames="interpret")
def copy_same_memory_pallas(
    src: Cache, dst: Cache, ids: jaxsync.Packed, interpret: bool = False
) -> Cache:
    """Same contract as the XLA `_copy_same_memory` (ids padded with out-of-range dst ids)."""
    src_ids, dst_ids = ids["src"], ids["dst"]
    return jax.tree.map(lambda s, d: _copy_leaf(s, d, src_ids, dst_ids, interpret), src, dst)
