"""The one output contract of every model path.

Inside any jit, every family's `forward` returns an `Encoded`: rows `[R, D]` in the model's dtype
(the items' rows first, contiguous and in item order, padding after them), per-item finite
flags, and named extras. On the host, the family's plan says how many rows each item owns
(`plan.lengths`), and `Embeddings.of(encoded, plan)` is that result with its host offsets: what
every entry returns. A server can swap an entry for a forward in its own jit (or back) with no
family-specific glue.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np


class Encoded(NamedTuple):
    """What every family's pure `forward` returns (a pytree: it leaves any jit as is).

    Attributes:
      rows: [R, D] in the model's dtype; item i's rows are `rows[o_i : o_i + n_i]` with `n_i =
        plan.lengths[i]` and `o_i` their running sum (contiguous, item order); later rows are
        padding.
      finite: [I] bool, I >= the item count (a bucket): entry i < items is True when item i's
        input and every one of its rows are finite; entries past the items are padding.
      extras: named device arrays a family also offers (e.g. glm4v's rows before the patch
        merger, chameleon's image-token ids), laid out as its docstring says; None for none.
    """

    rows: jax.Array
    finite: jax.Array
    extras: dict[str, jax.Array] | None = None


@functools.lru_cache(maxsize=4096)
def _rows(offset: int, length: int):
    """A jitted slice of rows [offset, offset + length): bounds are compile-time constants.

    Eager `x[o : o + n]` (and eager `lax.slice`) upload the start index as a device scalar, an
    implicit transfer that a transfer guard refuses; inside jit the bounds are static.
    """
    return jax.jit(lambda x: x[offset : offset + length])


def row_layout(
    lengths: Sequence[int], offsets: Sequence[int] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lengths, offsets) as tuples of Python ints; offsets default to contiguous from row 0.

    Python ints: a numpy integer offset would make `Embeddings.split()` upload a dynamic
    slice index.

    Raises:
      TypeError: a length or offset that is not an integer (a bool, a float such as 2.7).
      ValueError: a negative length or offset, or offsets of another count than lengths.
    """
    lengths = _counts(lengths, "lengths")
    if offsets is None:
        starts, total = [], 0
        for n in lengths:
            starts.append(total)
            total += n
        offsets = starts
    offsets = _counts(offsets, "offsets")
    if len(offsets) != len(lengths):
        raise ValueError(f"{len(offsets)} offsets for {len(lengths)} lengths")
    return lengths, offsets


def _counts(values: Sequence[int], name: str) -> tuple[int, ...]:
    """Host row counts as Python ints, refusing what would be silently truncated."""
    if isinstance(values, jax.Array):
        raise TypeError(f"{name} must be host integers, got a device array")
    out = []
    for v in (
        np.asarray(values, dtype=object).reshape(-1).tolist()
        if not isinstance(values, tuple | list)
        else values
    ):
        if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must hold integers, got {v!r}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
        out.append(int(v))
    return tuple(out)


@jax.tree_util.register_pytree_node_class
class Embeddings:
    """Per-item embeddings packed in one padded device array, with host-side lengths.

    Attributes:
      embeddings: [R, D] device rows; rows `offsets[i] : offsets[i] + lengths[i]` belong to item
        `i` (items in input order, contiguous); rows past the last item are padding.
      lengths: per-item token counts (host ints; 0 for an empty item).
      offsets: per-item first row (host ints).
      extras: optional named device arrays a family also returns (e.g. the tower's hidden
        states before a merger), laid out by the same rows unless its docstring says otherwise.
    """

    __slots__ = ("embeddings", "extras", "lengths", "offsets")  # built per call: no instance dict

    def __init__(
        self,
        embeddings: jax.Array,
        lengths: Sequence[int],
        offsets: Sequence[int] | None = None,
        extras: dict[str, Any] | None = None,
    ):
        self.embeddings = embeddings
        self.lengths, self.offsets = row_layout(lengths, offsets)
        self.extras = {} if extras is None else dict(extras)
        rows = embeddings.shape[0] if getattr(embeddings, "ndim", 0) else 0
        past = [
            i
            for i, (o, n) in enumerate(zip(self.offsets, self.lengths, strict=True))
            if o + n > rows
        ]
        if past:
            raise ValueError(
                f"items {past[:8]} end past the {rows} rows (offsets {self.offsets}, lengths "
                f"{self.lengths})"
            )

    @classmethod
    def of(cls, encoded: Encoded, plan: Any) -> Embeddings:
        """A forward's `Encoded` result with the host layout of the plan it ran on
        (`plan.lengths`, contiguous from row 0): what the family's entry returns.

        `extras` holds "finite" and the forward's own extras.
        """
        extras = {"finite": encoded.finite, **(encoded.extras or {})}
        return cls(encoded.rows, plan.lengths, extras=extras)

    @property
    def rows(self) -> jax.Array:
        """The [R, D] device rows (the same array as `embeddings`)."""
        return self.embeddings

    @property
    def finite(self) -> jax.Array | None:
        """Per-item finite flags ([I] bool, item i at entry i), when the path computes them."""
        return self.extras.get("finite")

    @classmethod
    def from_layout(
        cls,
        embeddings: jax.Array,
        layout: tuple[tuple[int, ...], tuple[int, ...]],
        extras: dict[str, Any] | None = None,
    ) -> Embeddings:
        """An `Embeddings` of a row layout an entry computed once per plan with
        `Embeddings.layout(lengths, offsets)`: the per-call output then costs no per-item
        conversion. `extras` is kept as given (a dict of the caller's own)."""
        out = object.__new__(cls)
        out.embeddings = embeddings
        out.lengths, out.offsets = layout
        out.extras = {} if extras is None else extras
        return out

    layout = staticmethod(row_layout)

    @classmethod
    def assembler(
        cls, layout: tuple[tuple[int, ...], tuple[int, ...]], extras: tuple[str, ...] = ()
    ) -> Any:
        """`outs -> Embeddings` of a program's outputs `(rows, *extras)` in one Python frame:
        the finish of an entry's kept call (`TowerProgram.prepared`)."""
        lengths, offsets = layout

        def assemble(outs: Any) -> Embeddings:
            out = object.__new__(cls)
            out.embeddings = outs[0]
            out.lengths, out.offsets = lengths, offsets
            out.extras = dict(zip(extras, outs[1:], strict=True))
            return out

        return assemble

    def tree_flatten(self):
        names = tuple(sorted(self.extras))
        return (self.embeddings, *(self.extras[n] for n in names)), (
            self.lengths,
            self.offsets,
            names,
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        lengths, offsets, names = aux  # already a row layout
        extras = dict(zip(names, children[1:], strict=True))
        return cls.from_layout(children[0], (lengths, offsets), extras)

    @property
    def num_tokens(self) -> int:
        """Real rows over all items."""
        return sum(self.lengths)

    def split(self) -> list[jax.Array]:
        """Per-item device slices `[lengths[i], D]` (no device->host read).

        Each distinct (offset, length) is a small slice program of its own; a consumer that
        scatters every item's tokens at once should use `embeddings[:num_tokens]` instead.
        """
        return [
            _rows(o, n)(self.embeddings) for o, n in zip(self.offsets, self.lengths, strict=True)
        ]

    def __repr__(self) -> str:
        return (
            f"Embeddings(rows={tuple(self.embeddings.shape)}, lengths={self.lengths}, "
            f"extras={sorted(self.extras)})"
        )
