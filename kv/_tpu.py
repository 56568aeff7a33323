"""The block copy on TPUs: a Pallas (Mosaic TPU) kernel that moves each block HBM -> HBM by DMA.

Why: XLA runs the copy as a gather and a scatter, two passes over the copied bytes through the
vector units. Here each grid step reads its (src, dst) ids from scalar memory (scalar prefetch)
and starts one DMA of a whole block straight from the source cache into the donated
destination: no VMEM staging, no vector work, any block shape and dtype (a DMA copies bytes; the
(8, 128) tiling rules of VMEM blocks do not apply to HBM refs). Padded entries carry
out-of-range destination ids and are skipped, as in the GPU kernel (`_pallas`).

All DMAs of a call are started before any is waited on (one semaphore counts them), so the
copy engine keeps many blocks in flight. Under `_pallas.INTERPRET == "tpu"` the kernel runs in
Pallas' TPU interpreter on any backend (tests).
"""

from __future__ import annotations

import jax


# Pallas is imported where a kernel is built, not with the module: on jax >= 0.12 importing
# `jax.experimental.pallas` makes every warm jit of the caller trace and compile again once.


def _kernel(src_ids, dst_ids, src, dst_in, out, sem):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    del dst_in  # aliased to `out`: blocks not written keep their values
    num_blocks = out.shape[0]

    def dma(i):
        d = dst_ids[i]
        return pltpu.make_async_copy(src.at[pl.ds(src_ids[i], 1)], out.at[pl.ds(d, 1)], sem), d

    def start(i, carry):
        copy, d = dma(i)

        @pl.when(d < num_blocks)  # padding entries point past the cache
        def _():
            copy.start()

        return carry

    def wait(i, carry):
        copy, d = dma(i)

        @pl.when(d < num_blocks)
        def _():
            copy.wait()

        return carry

    n = src_ids.shape[0]
    jax.lax.fori_loop(0, n, start, 0)
    jax.lax.fori_loop(0, n, wait, 0)


def copy_leaf(s: jax.Array, d: jax.Array, src_ids, dst_ids, interpret: bool) -> jax.Array:
    """d[dst_ids[k]] <- s[src_ids[k]] for one leaf `[P, *block]` (`s` and `d` share the block
    shape and dtype), d updated in place (its buffer is aliased to the output)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    any_space = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(d.shape, d.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[any_space, any_space],
            out_specs=any_space,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={3: 0},  # (src_ids, dst_ids, src, dst): dst is the output
        interpret=pltpu.InterpretParams() if interpret else False,
    )(src_ids, dst_ids, s, d)
