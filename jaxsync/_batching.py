"""Device batches of fewer items than their plan's bucket: padded to it on the device.

An entry whose program takes a batch axis bucketed by the plan (images per call) may accept a
device batch of any size up to the bucket: `BucketEntry` pads it along axis 0 on the device
(`pad_batch`, keeping the batch's placement), runs the program, and keeps the pad and the
program as the repeated call. The per-batch-size programs a bucket shares (the pads, the
family's own slices of the output) compile on the bucket's first call (`Warmer`), so later
calls of any size in the bucket compile nothing.
"""

from __future__ import annotations

import functools as ft
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync._calls import prepared_call, reads
from jaxsync._entry import Planned, TowerEntry
from jaxsync._outputs import Encoded
from jaxsync._placement import batch_split, committed, replicated


@ft.cache
def pad_batch(sharding: jax.sharding.Sharding | None) -> Callable[[jax.Array, int], jax.Array]:
    """`pad(x, rows)`: `x` zero padded at the end of axis 0 to `rows`, placed at `sharding`
    (the batch's own, so the padded rows divide its shards; None: the compiler's choice)."""

    def pad(x: jax.Array, rows: int) -> jax.Array:
        return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))

    return jax.jit(pad, static_argnums=1, out_shardings=sharding)


class BatchSplit:
    """How a batch is split over devices, per placement: `(shards, meta_at)`, memoised.

    A batch may be split over a mesh's data axis (dimension 0) and nowhere else
    (`jaxsync._placement.batch_split`): `shards` is the number of pieces (the plan pads the
    batch to a multiple of it) and `meta_at` where the call's metadata goes (replicated over
    the batch's devices). Device input is taken where it lives, host input at `placement`.
    Only valid placements are kept, so a repeated call costs one lookup.
    """

    def __init__(self, placement: Any, name: str):
        self.placement, self.name = placement, name
        self.known: dict[Any, tuple[int, Any]] = {}

    def __call__(self, x: Any) -> tuple[int, Any]:
        """`(shards, meta_at)` of device input `x` where it lives, else of host input."""
        on_device = isinstance(x, jax.Array)
        where = committed(x) if on_device else self.placement
        hit = self.known.get(where)
        if hit is None:
            name = self.name if on_device else "placement"
            hit = self.known[where] = (batch_split(where, name), replicated(where, "device"))
        return hit

    def shards(self, where: Any) -> int:
        """The shards of a batch placed at `where`, a placement seen before."""
        return self.known[where][0]

    @reads("sharding", "committed")
    def check(self, x: jax.Array) -> None:
        """Refuses a device batch split off dimension 0 (ValueError)."""
        self(x)


class Warmer:
    """Compiles a bucket's per-batch-size programs once, on the bucket's first call.

    `warm(x, encoded, rows, where)` after the first call of a bucket of `rows` on input `x`
    placed at `where` (per input kind, dtype and placement): `each(encoded, n)` for every batch
    size `n` in `sizes(rows, where)`, and for device input the pad of `n` items to `rows`,
    dispatched on arrays of the very placement later calls pass. A traced call warms nothing.
    Share one `Warmer` between the entries of one encoder: a bucket is warmed once for all.
    """

    def __init__(
        self,
        sizes: Callable[[int, Any], Iterable[int]],
        each: Callable[[Encoded, int], Any],
    ):
        self.sizes, self.each = sizes, each
        self.warmed: set[Hashable] = set()

    def __call__(self, x: Any, out: Encoded, rows: int, where: Any) -> None:
        if isinstance(out.rows, jax.core.Tracer):  # traced by a static scan: nothing runs
            return
        on_device = isinstance(x, jax.Array)
        key = (rows, on_device, x.dtype, where)
        if key in self.warmed:
            return
        self.warmed.add(key)
        for n in self.sizes(rows, where):
            self.each(out, n)
            if n < rows and on_device:
                dummy = jax.device_put(np.zeros((n, *x.shape[1:]), x.dtype), where)
                pad_batch(where)(dummy, rows)


class BucketEntry(TowerEntry):
    """A `TowerEntry` whose device batch is padded on the device to its plan's bucket.

    Args (besides `TowerEntry`'s):
      batch: the plan's batch bucket, `batch(plan) -> rows` (the program's axis 0).
      output: the entry's output form, `output(encoded, planned)` (default: `planned.finish`,
        `Embeddings.of(encoded, plan)` on the plan's row layout computed once).
      warm: the encoder's `Warmer`, run after the first call of a bucket.

      split: the `BatchSplit` to share with another entry of the encoder (default: its own,
        of host input at `stage_at`).

    The split checks a device batch last, and `run` places metadata by it: beside the batch,
    over the devices it is split across.

    A device batch of `rows` items runs as `TowerEntry`'s (the program and the output, kept);
    a smaller one keeps the pad, the program and the output as its repeated call.
    """

    def __init__(
        self,
        program: Any,
        *,
        batch: Callable[[Any], int],
        output: Callable[[Encoded, Planned], Any] = lambda out, p: p.finish(out),
        warm: Warmer,
        name: str,
        checks: Iterable[Callable[[jax.Array], Any]] = (),
        stage_at: Any = None,
        split: BatchSplit | None = None,
        **options: Any,
    ):
        self.split = BatchSplit(stage_at, name) if split is None else split
        checks = (*checks, self.split.check)
        super().__init__(program, name=name, checks=checks, stage_at=stage_at, **options)
        self.batch, self.output, self.warm = batch, output, warm

    def run(self, x: Any, key: Hashable | None, planner: Callable, **options: Any) -> Any:
        """`TowerEntry.run`, the metadata placed by the batch split unless `options` say."""
        split = self.split
        at = dict(placement=lambda: split(None)[1], near=lambda x: split(x)[1])
        return super().run(x, key, planner, **{**at, **options})

    def finished(self, x: Any, out: Encoded, p: Planned, where: Any) -> Any:
        self.warm(x, out, self.batch(p.plan), where)
        return self.output(out, p)

    def device(
        self, x: jax.Array, key: Hashable | None, p: Planned, *, unbatched: bool = False
    ) -> Any:
        if self.fits is not None:
            self.fits(x, p.plan)
        rows, where, output = self.batch(p.plan), committed(x), self.output
        pad = None if x.shape[0] == rows else pad_batch(where)

        def encode(x: jax.Array) -> tuple[Encoded, Any]:
            out = self.program(x if pad is None else pad(x, rows), p.meta)
            return out, output(out, p)

        out, result = encode(x)
        self.warm(x, out, rows, where)
        if pad is None:  # a full bucket: the program and the output, nothing else
            run = self.program.prepared(p.meta, finish=lambda out: output(out, p), name=self.name)
        else:
            run = prepared_call(lambda x: encode(x)[1], self.name)
        self.calls.keep(key, run)
        return result
