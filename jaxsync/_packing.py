"""Model state as a few flat buffers: fewer jit arguments per call (`jaxsync.TowerProgram`).

A jitted forward pays host dispatch per argument (a few microseconds each on a GPU host, under
either runtime client). `PackedLeaves` concatenates state arrays into one
flat device buffer per dtype, once, and `unpack` slices them back by static offsets inside the
jitted function. Whether XLA then reads the slices in place or copies them is up to the backend:
on a GPU it copies big weights out of a flat buffer (a few percent of device time). Stacked
layers packed in rows (`rows=True`, one [L, S] buffer per dtype) are sliced once per layer by
the scan; a GPU copies each layer's slice, and does the same for stacked leaves passed one
array per weight (same device time), so the rows cost nothing over stacking. Measure device
time before making a packing a default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


class PackedLeaves:
    """Arrays packed into one buffer per dtype.

    Args:
      leaves: jax.Arrays that share one placement (a device, or one sharding that replicates
        them all): packing concatenates them, which would reshard anything split.
      rows: the leaves are stacked layers sharing a leading axis [L, ...]: pack them layer by
        layer into one [L, S] buffer per dtype, row l holding layer l's leaves. `unpack` of
        one row (inside a `jax.lax.scan` over the buffers, see `jaxsync._tower.PackedStack`) gives
        that layer's leaves, so the loop slices each weight out of the buffer once per layer,
        as it slices stacked leaves, with no copy of the whole buffer first. Without it, one
        flat buffer per dtype: big matmul weights sliced out of it may be copied by XLA before
        use (a few percent of device time on a GPU).

    Attributes:
      buffers: the jit arguments: one buffer per dtype, sorted by dtype name.

    >>> import jax.numpy as jnp
    >>> p = PackedLeaves([jnp.ones((2, 3)), jnp.zeros(4, jnp.int32), jnp.arange(2.0)])
    >>> [b.shape for b in p.buffers], [x.shape for x in p.unpack(p.buffers)]
    ([(8,), (4,)], [(2, 3), (4,), (2,)])
    >>> q = PackedLeaves([jnp.ones((5, 2, 3)), jnp.ones((5, 4))], rows=True)
    >>> [b.shape for b in q.buffers], [x.shape for x in q.unpack([q.buffers[0][0]])]
    ([(5, 10)], [(2, 3), (4,)])
    """

    def __init__(self, leaves: Sequence[jax.Array], *, rows: bool = False):
        if not leaves:
            raise ValueError("nothing to pack")
        for x in leaves:
            if not isinstance(x, jax.Array):
                raise TypeError(f"PackedLeaves takes jax.Arrays, got {type(x).__name__}")
        shardings = {x.sharding for x in leaves}
        if len(shardings) != 1 or not next(iter(shardings)).is_fully_replicated:
            raise ValueError(
                "PackedLeaves needs all leaves on one placement, replicated (got "
                f"{len(shardings)} shardings); packing would reshard split arrays"
            )
        lead = 1 if rows else 0  # leading axes kept: [L] per row-packed leaf
        if rows and (not leaves[0].ndim or len({x.shape[:1] for x in leaves}) != 1):
            raise ValueError("rows=True needs leaves that share one leading (layer) axis")
        dtypes = sorted({jnp.dtype(x.dtype) for x in leaves}, key=str)
        # Per leaf: (buffer, offset, shape of one row).
        layout, offsets = [], dict.fromkeys(range(len(dtypes)), 0)
        for x in leaves:
            b = dtypes.index(jnp.dtype(x.dtype))
            layout.append((b, offsets[b], tuple(x.shape[lead:])))
            offsets[b] += math.prod(x.shape[lead:])
        self._layout = tuple(layout)
        flat = [x.reshape(x.shape[:lead] + (-1,)) for x in leaves]
        self.buffers = [
            jnp.concatenate([f for f in flat if f.dtype == d], axis=lead) for d in dtypes
        ]

    def unpack(self, buffers: Sequence[jax.Array]) -> list[jax.Array]:
        """The leaves again, in their order (static slices; call inside jit). Buffers with
        leading axes (row-packed buffers [L, S]) give leaves with them; one row [S] gives one
        layer's leaves."""

        def leaf(buf: jax.Array, offset: int, shape: tuple[int, ...]) -> jax.Array:
            size = math.prod(shape)
            piece = jax.lax.slice_in_dim(buf, offset, offset + size, axis=buf.ndim - 1)
            return piece.reshape(buf.shape[:-1] + shape)

        return [leaf(buffers[b], offset, shape) for b, offset, shape in self._layout]
