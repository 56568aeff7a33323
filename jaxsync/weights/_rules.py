"""Mapping rules from Hugging Face checkpoint keys to NNX parameter paths, and layout transforms.

Every transform knows the stored shape it expects for a given parameter shape (its inverse shape
map), so the loader checks a tensor's stored layout from the file header before reading or
transforming it: a tensor in another layout with the same element count (a transposed Linear, a
Conv3d with C and T swapped) is refused instead of loading scrambled.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import jax


Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Transform:
    """A layout change from the stored tensor to the parameter, with its inverse shape map.

    Attributes:
      fn: stored tensor -> parameter value.
      stored_shape: parameter shape -> the stored shape `fn` expects; None when it cannot be
        derived (the loader then checks the shape after `fn` only). Raises `ValueError` when the
        transform does not apply to a parameter of that shape.
      name: shown in error messages.
      axes_only: the transform only permutes axes, whatever the shape (`linear`, `conv`,
        `transpose` and compositions of them): a block of the parameter is the same permutation
        of a block of the stored tensor, so a multi-process load reads just that block.
    """

    fn: Callable[[jax.Array], jax.Array]
    stored_shape: Callable[[Shape], Shape | None]
    name: str = "transform"
    axes_only: bool = False

    def __call__(self, w: jax.Array) -> jax.Array:
        return self.fn(w)

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Rule:
    """One checkpoint-key pattern and where its tensor goes.

    Attributes:
      pattern: regex, `re.fullmatch`-ed against the checkpoint key (after `strip`).
      target: dotted NNX path with `\\1`-style backreferences, e.g. `r"layers.\\1.attn.q.kernel"`.
      transform: optional layout change applied to the tensor: a `Transform` (`linear`, `conv`,
        `transpose`, `reshape`, `compose`), or a plain traceable callable, whose result shape alone
        is checked (abstractly, before reading); wrap it in `Transform` to check the stored shape.
    """

    pattern: str
    target: str
    transform: Transform | Callable[[jax.Array], jax.Array] | None = None

    def match(self, key: str) -> str | None:
        m = re.fullmatch(self.pattern, key)
        return m.expand(self.target) if m else None


def expected_stored_shape(transform: Callable | None, target: Shape) -> Shape | None:
    """The stored shape `transform` maps onto a `target`-shaped parameter; None if unknown."""
    if transform is None:
        return tuple(target)
    if isinstance(transform, Transform):
        return transform.stored_shape(tuple(target))
    return None


def _ndim(name: str, target: Shape, ndim: int) -> None:
    if len(target) != ndim:
        raise ValueError(f"{name} maps onto {ndim}-D parameters, not shape {target}")


def _linear_stored(target: Shape) -> Shape:
    _ndim("linear", target, 2)
    return (target[1], target[0])


# Transforms use array methods, so the loader applies them to host numpy arrays (no device
# program per tensor) and checks them abstractly on `jax.ShapeDtypeStruct`s alike.
linear = Transform(lambda w: w.T, _linear_stored, "linear", axes_only=True)
"""torch Linear weight [O, I] -> nnx.Linear kernel [I, O]."""


def conv(ndim: int) -> Transform:
    """torch ConvNd weight [O, I, *k] -> nnx.Conv kernel [*k, I, O] for `ndim` spatial dims."""
    name = f"conv{ndim}d"

    def stored(target: Shape) -> Shape:
        _ndim(name, target, ndim + 2)
        return (target[-1], target[-2], *target[:-2])

    return Transform(
        lambda w: w.transpose((*range(2, ndim + 2), 1, 0)), stored, name, axes_only=True
    )


def transpose(*axes: int) -> Transform:
    """A fixed axis permutation: `parameter = stored.transpose(axes)`."""
    if sorted(axes) != list(range(len(axes))):
        raise ValueError(f"transpose axes {axes} are not a permutation of 0..{len(axes) - 1}")
    name = f"transpose{axes}"

    def stored(target: Shape) -> Shape:
        _ndim(name, target, len(axes))
        out = [0] * len(axes)
        for i, a in enumerate(axes):  # parameter dim i is stored dim axes[i]
            out[a] = target[i]
        return tuple(out)

    return Transform(lambda w: w.transpose(axes), stored, name, axes_only=True)


def reshape(*shape: int, stored: Shape | None = None) -> Transform:
    """A fixed reshape to `shape`, from a tensor stored as `stored`.

    Without `stored`, any layout of the same element count passes and only the result is checked;
    give `stored` so that a tensor in another layout is refused before it is read.
    """
    name = f"reshape{shape}"
    if stored is not None and -1 not in shape and math.prod(stored) != math.prod(shape):
        raise ValueError(f"{name}: stored shape {tuple(stored)} has another element count")

    def stored_shape(target: Shape) -> Shape | None:
        if len(target) != len(shape) or any(
            s not in (-1, t) for s, t in zip(shape, target, strict=True)
        ):
            raise ValueError(f"{name} maps onto parameters of shape {shape}, not {target}")
        return None if stored is None else tuple(stored)

    return Transform(lambda w: w.reshape(shape), stored_shape, name)


def compose(*fs: Transform | Callable) -> Transform:
    """Applies `fs` left to right; its stored shape is the inverse maps applied right to left."""
    name = "compose(" + ", ".join(getattr(f, "name", getattr(f, "__name__", "?")) for f in fs) + ")"

    def fn(w: jax.Array) -> jax.Array:
        for g in fs:
            w = g(w)
        return w

    def stored(target: Shape) -> Shape | None:
        shape: Shape | None = tuple(target)
        for g in reversed(fs):
            shape = expected_stored_shape(g, shape)
            if shape is None:
                return None
        return shape

    axes_only = all(getattr(f, "axes_only", False) for f in fs)
    return Transform(fn, stored, name, axes_only=axes_only)
