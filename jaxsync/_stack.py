"""A tower's repeated layers stored stacked, `[L, ...]` per weight kind, and run with one scan.

The scanned-layers idiom of JAX model code (MaxText's `scan_layers`, penzai's `LayerStack`, the
Flax NNX guide's `nnx.vmap` + scan): the L layers are one module whose every parameter carries a
leading layer axis. What that buys a model that servers call inside their own jit:
- the state holds one leaf per weight kind, not per layer, so the jit-argument count and the
  Python flatten of the state do not grow with depth;
- the trace holds one layer, so compile time does not grow with depth either;
- there is one forward: the stack runs its layers itself, so no caller can skip them by looping
  over a list.

    blocks = jaxsync.LayerStack(lambda r: Block(cfg, rngs=r), cfg.depth, rngs=rngs)
    x = blocks(x, cos, sin, mask)          # x = layer_i(x, cos, sin, mask), i = 0..L-1
    blocks.at(3)                           # layer 3 alone, for inspection and per-layer tests

A checkpoint's per-layer keys (`blocks.3.attn.qkv.weight`) load into slice 3 of the stacked
parameter (`jaxsync.weights.load_weights` knows the stack), and partition rules get a leading
`None` for the layer axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


class LayerStack(nnx.Module):
    """`num_layers` structurally identical layers, every parameter stacked `[L, ...]`.

    Args:
      make: `rngs -> layer`, the constructor of one layer. It is traced once under `nnx.vmap`,
        so every layer shares its static attributes (activation, attention choice) by
        construction, and each gets its own random initialisation.
      num_layers: L >= 0. A stack of zero layers is the identity.
      rngs: initialisation randomness (the loader builds the stack abstractly).

    Attributes:
      layer: the layer module whose every array carries the leading layer axis.
      num_layers: L.
    """

    def __init__(
        self,
        make: Callable[[nnx.Rngs], nnx.Module] | None,
        num_layers: int,
        *,
        rngs: nnx.Rngs | None = None,
        stacked: nnx.Module | None = None,
    ):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
        self.num_layers = num_layers
        if stacked is not None:  # `LayerStack.of`: the layers' arrays, already stacked
            self.layer = stacked
            return
        if num_layers == 0:  # vmap cannot split keys zero ways: one abstract layer, zero rows
            graphdef, state = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
            empty = jax.tree.map(lambda a: jnp.zeros((0, *a.shape), a.dtype), state)
            self.layer = nnx.merge(graphdef, empty)
            return

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def build(r: nnx.Rngs) -> nnx.Module:
            return make(r)

        self.layer = build(rngs)

    def __len__(self) -> int:
        return self.num_layers

    def __call__(self, x: Any, *args: Any, span: tuple[int, int] | None = None) -> Any:
        """`x = layer_i(x, *args)` for i = 0..L-1, as one `jax.lax.scan`.

        Args:
          x: the carry; every layer returns the same shape and dtype.
          *args: per-call values every layer reads (masks, rotary tables), closed over.
          span: `(start, stop)` to run layers start..stop-1 only (a tower whose stacked layers
            are interleaved with other modules runs them in runs).
        """
        start, stop = (0, self.num_layers) if span is None else check_span(span, self.num_layers)
        if start == stop:  # no layer to run (a slice of a zero-row array cannot be traced)
            return x
        graphdef, state = nnx.split(self.layer)

        def layer_at(i: jax.Array) -> nnx.Module:
            row = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), state)
            return nnx.merge(graphdef, row)

        return scan_indices(layer_at, x, args, start, stop)

    def at(self, i: int) -> nnx.Module:
        """Layer `i` alone: a module over slices of the stacked arrays (a copy of its weights)."""
        n = self.num_layers
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"layer {i!r} is not in 0..{self.num_layers - 1}")
        graphdef, state = nnx.split(self.layer)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    @classmethod
    def of(cls, layers: Sequence[nnx.Module]) -> LayerStack:
        """A stack of existing layers (same structure, shapes and dtypes), their arrays stacked.

        Raises:
          ValueError: no layers, or layers of another structure (graphdef) or leaf shapes.
        """
        if not layers:
            raise ValueError("LayerStack.of needs at least one layer")
        splits = [nnx.split(layer) for layer in layers]
        graphdef = splits[0][0]
        for i, (other, state) in enumerate(splits[1:], start=1):
            if other != graphdef:
                raise ValueError(
                    f"layer {i} does not share layer 0's structure (modules, leaf paths or static "
                    "attributes differ)"
                )
            if jax.tree.map(jnp.shape, state) != jax.tree.map(jnp.shape, splits[0][1]):
                raise ValueError(f"layer {i} has other leaf shapes than layer 0")
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *(s for _, s in splits))
        return cls(None, len(layers), stacked=nnx.merge(graphdef, stacked))


def check_span(span: tuple[int, int], num_layers: int) -> tuple[int, int]:
    start, stop = span
    if not 0 <= start <= stop <= num_layers:
        raise ValueError(f"span {span} is outside 0..{num_layers}")
    return start, stop


def scan_indices(
    layer_at: Callable[[jax.Array], nnx.Module], x: Any, args: tuple, start: int, stop: int
) -> Any:
    """`x = layer_at(i)(x, *args)` for i = start..stop-1, as one `jax.lax.scan` over indices.

    The layer index is data the loop reads, not the loop counter itself: XLA:GPU turns a slice
    of a stacked weight at the loop counter into a device-to-device memcpy whose offset the host
    computes per iteration, one per stacked weight per layer, and those stay outside the
    loop body's command buffers (the host launches each, and the GPU idles between them on
    small batches). Indices behind `optimization_barrier` are not known to the compiler, so each
    layer's slices stay ordinary fused kernels of the body: the same program in every call
    form (entry, a server's jit over stacked leaves, `shard_map`) and on every backend.
    """

    def step(carry: Any, i: jax.Array) -> tuple[Any, None]:
        return layer_at(i)(carry, *args), None

    indices = jax.lax.optimization_barrier(jnp.arange(start, stop, dtype=jnp.int32))
    return jax.lax.scan(step, x, indices)[0]


def stacks(module: nnx.Module) -> dict[str, int]:
    """`{dotted path of each LayerStack in module: its num_layers}` (works on abstract modules)."""
    out = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, LayerStack):
            out[".".join(str(p) for p in path)] = node.num_layers
    return out
