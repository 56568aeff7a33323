"""Identical layers as one stacked state, run with `jax.lax.scan`.

A tower of L identical layers passes L x (leaves per layer) arrays to jit on every call (each
costs host dispatch time) and traces L copies of the layer into the HLO. Stacking
the layers' leaves along a new leading axis makes that (leaves per layer) arguments and one
traced layer, at the cost of a loop in the compiled program (the standard practice of JAX LLM
stacks such as MaxText).

  layer_def, stacked = stack_layers(tower.layers)       # once, at construction
  x = scan_layers(layer_def, stacked, x, mask)          # inside jit: layer(x, mask) L times
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


def stack_layers(layers: Sequence[nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Splits structurally identical layers into one graphdef and one stacked state.

    Args:
      layers: L >= 1 modules with one graph structure (same classes, static attributes and leaf
        paths; static attributes compare by equality, so e.g. an activation must be the same
        function object in every layer, not a fresh lambda per layer).

    Returns:
      `(graphdef, state)`: every leaf of `state` is the layers' leaves stacked, [L, *leaf.shape].
      Each stack is one `jnp.stack` on the leaves' own device(s); the layers' arrays are not
      referenced by the result, so the caller frees them by dropping the layers (until then
      both copies are alive).

    Raises:
      ValueError: no layers, or layers whose structure (graphdef) or leaf shapes/dtypes differ.
    """
    if not layers:
        raise ValueError("stack_layers needs at least one layer")
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    for i, (other, _) in enumerate(splits[1:], start=1):
        if other != graphdef:
            raise ValueError(
                f"layer {i} ({type(layers[i]).__name__}) does not share layer 0's structure "
                f"({type(layers[0]).__name__}): different modules, leaf paths or static "
                "attributes (a per-layer lambda or config value differs)"
            )
    specs = [[(a.shape, a.dtype) for a in jax.tree.leaves(s)] for _, s in splits]
    for i, spec in enumerate(specs[1:], start=1):
        if spec != specs[0]:
            raise ValueError(f"layer {i} has other leaf shapes or dtypes than layer 0")
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s for _, s in splits))
    return graphdef, stacked


def scan_layers(
    graphdef: nnx.GraphDef,
    stacked_state: Any,
    x: Any,
    *args: Any,
    unpack: Callable[[Any], nnx.State] | None = None,
) -> Any:
    """Runs `x = layer_i(x, *args)` for i = 0..L-1 as one `jax.lax.scan`.

    Args:
      graphdef: the layer graphdef from `stack_layers`.
      stacked_state: the stacked state, leaves [L, ...] (traced inside jit); or, with `unpack`,
        any pytree of [L, ...] arrays, e.g. `jaxsync.PackedLeaves(..., rows=True).buffers`.
      x: the carry, e.g. [B, T, D]; each layer must return the same shape and dtype.
      *args: passed unchanged to every layer (closed over, not scanned), e.g. a mask.
      unpack: maps one layer's slice of `stacked_state` to that layer's state.

    Returns:
      x after the L layers, same shape and dtype as the input.
    """

    def step(carry, layer_slice):
        layer_state = layer_slice if unpack is None else unpack(layer_slice)
        return nnx.merge(graphdef, layer_state)(carry, *args), None

    out, _ = jax.lax.scan(step, x, stacked_state)
    return out


class SplitLayers(NamedTuple):
    """A module split into its non-layer part and its stacked layers (see `split_layers`)."""

    graphdef: nnx.GraphDef  # the module with an empty layer list
    state: nnx.State  # its non-layer leaves (the module's own arrays, not copies)
    layer_graphdef: nnx.GraphDef
    layer_state: nnx.State  # leaves [L, ...]


def split_layers(module: nnx.Module, attr: str = "layers") -> SplitLayers:
    """`nnx.split` of `module` with `module.<attr>` (a list of identical layers) stacked.

    `module` itself is not changed: a shallow copy sharing its arrays gets an empty layer list,
    so merging `graphdef` and `state` gives the module without its layers (for the code before
    and after them) and `scan_layers(layer_graphdef, layer_state, ...)` runs the layers.

    Raises:
      ValueError: as `stack_layers`.
    """
    layer_graphdef, layer_state = stack_layers(list(getattr(module, attr)))
    shell = nnx.merge(*nnx.split(module))  # new Variables over the same arrays: no copy
    setattr(shell, attr, nnx.List([]))
    graphdef, state = nnx.split(shell)
    return SplitLayers(graphdef, state, layer_graphdef, layer_state)
