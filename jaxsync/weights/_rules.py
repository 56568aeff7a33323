"""Mapping rules from Hugging Face checkpoint keys to NNX parameter paths, and layout transforms."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp


Transform = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One checkpoint-key pattern and where its tensor goes.

    Attributes:
      pattern: regex, `re.fullmatch`-ed against the checkpoint key (after `strip`).
      target: dotted NNX path with `\\1`-style backreferences, e.g. `r"layers.\\1.attn.q.kernel"`.
      transform: optional layout change applied to the tensor (see `linear`, `conv`).
    """

    pattern: str
    target: str
    transform: Transform | None = None

    def match(self, key: str) -> str | None:
        m = re.fullmatch(self.pattern, key)
        return m.expand(self.target) if m else None


def linear(w: jax.Array) -> jax.Array:
    """torch Linear weight [out, in] -> nnx.Linear kernel [in, out]."""
    return jnp.transpose(w)


def conv(ndim: int) -> Transform:
    """torch ConvNd weight [O, I, *k] -> nnx.Conv kernel [*k, I, O] for `ndim` spatial dims."""

    def f(w: jax.Array) -> jax.Array:
        if w.ndim != ndim + 2:
            raise ValueError(f"conv{ndim}d weight must have {ndim + 2} dims, got shape {w.shape}")
        return jnp.transpose(w, (*range(2, ndim + 2), 1, 0))

    f.__name__ = f"conv{ndim}d"
    return f


def transpose(*axes: int) -> Transform:
    """A fixed axis permutation."""
    return lambda w: jnp.transpose(w, axes)


def reshape(*shape: int) -> Transform:
    """A fixed reshape."""
    return lambda w: jnp.reshape(w, shape)


def compose(*fs: Transform) -> Transform:
    """Applies `fs` left to right."""

    def f(w: jax.Array) -> jax.Array:
        for g in fs:
            w = g(w)
        return w

    return f
