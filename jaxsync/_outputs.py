"""The one output container of every model path: padded device rows plus host bookkeeping."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax


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
    """
    lengths = tuple(int(n) for n in lengths)
    if offsets is None:
        starts, total = [], 0
        for n in lengths:
            starts.append(total)
            total += n
        offsets = starts
    return lengths, tuple(int(o) for o in offsets)


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
