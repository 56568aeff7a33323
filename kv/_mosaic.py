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
measured the same.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


TILE_BYTES = 32768
"""Bytes one program stages through shared memory; at most 256 rows (a TMA box limit)."""


def tile_rows(rows: int, cols: int, itemsize: int) -> int:
    """Rows per program: a power of two dividing `rows` (itself a power of two)."""
    return max(1, min(rows, 256, TILE_BYTES // (cols * itemsize)))


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


def copy_leaf(s3: jax.Array, d3: jax.Array, src_ids: jax.Array, dst_ids: jax.Array) -> jax.Array:
    """`d3[dst_ids[k]] <- s3[src_ids[k]]` on `[P, rows, cols]` views, d3 updated in place.

    `d3` becomes a mutable ref the kernel writes; the call lowers to one Mosaic GPU custom call
    whose output aliases d3's buffer, so a donated cache is not copied."""
    _, rows, cols = d3.shape
    tile = tile_rows(rows, cols, d3.dtype.itemsize)
    out = jax.new_ref(d3)
    pl.kernel(
        functools.partial(_body, tile=tile),
        out_type=(),
        mesh=plgpu.Mesh(grid=(src_ids.shape[0], rows // tile), grid_names=("block", "tile")),
    )(src_ids, dst_ids, s3, out)
    return out[...]
