"""Mosaic GPU variant of the block copy kernel (`copy_blocks(..., impl="mosaic")`).

Why: Pallas will remove its Triton backend, which the default GPU kernel (`kv._pallas`) is pinned
to. This variant uses Pallas' Mosaic GPU backend instead (`pl.kernel` on a `plgpu.Mesh`; Mosaic
GPU through `pallas_call` is deprecated): each program moves one `[1, tile, cols]` slab of one
block with the Hopper bulk tensor copy engine (TMA), global -> shared -> global, reading its ids
from global memory. Padding entries point past the cache and are skipped, as in Triton's.

Needs a Hopper-class GPU. It cross-lowers on any machine (a test checks the custom call and its
in-place aliasing), but it has no interpreter path: parity is proven on a GPU only
(`tests/kv/test_kv_pallas.py`). H200, jax 0.11.2, 2026-11-29 (`tools/explore_mosaic.py`,
released workload): bit-identical to XLA; 0.609 / 2.298 ms for 512 / 2048 blocks against
Triton's 0.618 / 2.211 and a same-size copy's 0.498 / 1.976; compile 4.3-4.9 s against 0.7-1 s.
So "auto" takes it only on Hopper GPUs under a jax without Triton; TILE_BYTES 8192 and 32768
measured the same. The 256-wide re-view of wider rows (MLA 512) passed GPU parity the same day.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.experimental import pallas as pl


try:  # an import failure only takes impl="mosaic" away
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None

TILE_BYTES = 32768
"""Bytes one program stages through shared memory."""
_BOX = 256  # TMA copies at most 256 elements along each dimension
_MIN_BYTES = 128  # Mosaic GPU copies whole multiples of a warpgroup's 128 bytes


def view(block: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """`(rows, cols)` view of one block `[..., cols]` for TMA, or None if this kernel cannot copy
    it: dims not powers of two, rows under 16 bytes, or blocks under 128 bytes. Rows wider than
    256 elements are re-viewed as 256-wide rows (a contiguous reshape)."""
    rows, cols = math.prod(block[:-1]), block[-1]
    if rows & (rows - 1) or cols & (cols - 1) or cols * itemsize < 16:
        return None
    if rows * cols * itemsize < _MIN_BYTES:
        return None
    if cols > _BOX:
        rows, cols = rows * cols // _BOX, _BOX
    return rows, cols


def tile_rows(rows: int, cols: int, itemsize: int) -> int:
    """Rows per program: a power of two dividing `rows` (itself a power of two)."""
    return max(1, min(rows, _BOX, TILE_BYTES // (cols * itemsize)))


def _body(src_ids, dst_ids, src, out, *, tile: int):
    i, r = jax.lax.axis_index("block"), jax.lax.axis_index("tile")
    d = dst_ids[i]

    def move(staged, loaded):
        rows = pl.ds(r * tile, tile)
        plgpu.copy_gmem_to_smem(src.at[pl.ds(src_ids[i], 1), rows], staged, loaded)
        plgpu.barrier_wait(loaded)
        plgpu.copy_smem_to_gmem(staged, out.at[pl.ds(d, 1), rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(d < out.shape[0])  # padding entries point past the cache
    def _():
        # Scratch through run_scoped: jax 0.11's pl.kernel lowering takes no scratch operands.
        smem = plgpu.SMEM((1, tile, out.shape[2]), out.dtype)
        pl.run_scoped(move, smem, plgpu.Barrier(num_arrivals=1))


def copy_leaf(s: jax.Array, d: jax.Array, src_ids: jax.Array, dst_ids: jax.Array) -> jax.Array:
    """`d[dst_ids[k]] <- s[src_ids[k]]` for `[P, ...]` leaves whose blocks `view` accepts, d
    updated in place.

    `d` becomes a mutable ref the kernel writes; the call lowers to one Mosaic GPU custom call
    whose output aliases d's buffer, so a donated cache is not copied."""
    rows, cols = view(tuple(d.shape[1:]), d.dtype.itemsize)
    s3 = s.reshape(s.shape[0], rows, cols)
    d3 = d.reshape(d.shape[0], rows, cols)
    tile = tile_rows(rows, cols, d3.dtype.itemsize)
    out = jax.new_ref(d3)
    pl.kernel(
        functools.partial(_body, tile=tile),
        out_type=(),
        mesh=plgpu.Mesh(grid=(src_ids.shape[0], rows // tile), grid_names=("block", "tile")),
    )(src_ids, dst_ids, s3, out)
    return out[...].reshape(d.shape)
