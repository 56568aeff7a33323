"""One forward, two call forms: the entry compiles exactly the function a server jits.

A family writes its forward once, as a pure function of the NNX module:

    def forward(model, pixels, meta):                 # callable inside any jit / shard_map
        x = model.embed(pixels, meta)
        x = model.blocks(x, meta.seg)                  # a jaxsync.LayerStack: one scan
        return model.head(x, meta)

A server calls it inside its own jitted step over its own `(graphdef, state)`, the state passed
as its flat leaves (as tpu-inference and sglang-jax do). `TowerProgram(model, forward)` is the
entry's side of the same thing: `jax.jit(lambda leaves, *inputs: forward(merge(leaves),
*inputs))` with the same jit options, so the two forms compile the same program and give the
same numbers. Its jit-argument count is the state's leaf count, which does not grow with depth
once the repeated layers are a `jaxsync.LayerStack`.

The jitted function holds no weights (only the module's structure), so every program built for
the same forward and structure shares one compiled cache: an encoder rebuilt per call from a
server's `(graphdef, state)` compiles nothing new.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxsync._calls import deleted_message


_SHARED: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()
_MAX_SHARED = 64


def _shared_jit(
    forward: Callable[..., Any], graphdef: nnx.GraphDef, treedef: Any, jit_kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """The jitted `(leaves, *inputs) -> forward(merge(leaves), *inputs)` of this structure."""
    key = (forward, graphdef, treedef, tuple(sorted(jit_kwargs.items(), key=lambda kv: kv[0])))
    try:
        hash(key)
    except TypeError:  # unhashable jit options: a program of its own
        key = None
    with _SHARED_LOCK:
        jitted = _SHARED.get(key) if key is not None else None
        if jitted is not None:
            _SHARED.move_to_end(key)
            return jitted

    def run(leaves: Sequence[jax.Array], *inputs: Any) -> Any:
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, list(leaves)))
        return forward(model, *inputs)

    jitted = jax.jit(run, **jit_kwargs)
    if key is not None:
        with _SHARED_LOCK:
            _SHARED[key] = jitted
            while len(_SHARED) > _MAX_SHARED:
                _SHARED.popitem(last=False)
    return jitted


class TowerProgram:
    """`forward(model, *inputs)` compiled over the model's state as a flat list of leaves.

    Args:
      model: the NNX module. Its arrays are read when the program is built and by
        `load_state`; an `nnx.update` of the module is not seen until `load_state(model)`.
      forward: the family's pure forward `forward(model, *inputs)`.
      **jit_kwargs: passed to `jax.jit` (e.g. `donate_argnums`, counted over `inputs` shifted
        by the one state argument).

    Attributes:
      num_state_args: jit arguments the state takes per call (its leaf count).
      platform: the platform the state lives on ("cpu", "gpu", "tpu"), or None without state.
      graphdef: the module's structure.
    """

    def __init__(self, model: nnx.Module, forward: Callable[..., Any], **jit_kwargs: Any):
        self._forward = forward
        self.graphdef, state = nnx.split(model)
        self._leaves, self._treedef = jax.tree_util.tree_flatten(state)
        self._spec = self._spec_of(self._leaves)
        self._jitted = _shared_jit(forward, self.graphdef, self._treedef, jit_kwargs)
        self.num_state_args = len(self._leaves)
        device = next(iter(self._leaves[0].sharding.device_set)) if self._leaves else None
        self.platform = None if device is None else device.platform

    @staticmethod
    def _spec_of(leaves: Sequence[jax.Array]) -> list[tuple[Any, Any, Any]]:
        return [(x.shape, x.dtype, x.sharding) for x in leaves]

    @property
    def leaves(self) -> list[jax.Array]:
        """The state's leaves as the program takes them (its first argument)."""
        return self._leaves

    def __call__(self, *inputs: Any) -> Any:
        """Runs the compiled forward on `inputs` (device arrays / `jaxsync.Packed`)."""
        return self._jitted(self._leaves, *inputs)

    def prepared(
        self, *rest: Any, finish: Callable[[Any], Any], name: str
    ) -> Callable[[jax.Array], Any]:
        """`x -> finish(self(x, *rest))`: an entry's kept call (see `jaxsync.CallCache`).

        The weights are read at call time, so `load_state` is seen. A deleted (donated) `x` is
        refused with `ValueError` naming `name` before anything is launched.
        """

        def call(x: jax.Array) -> Any:
            if not isinstance(x, jax.core.Tracer) and x.is_deleted():
                raise ValueError(deleted_message(name))
            return finish(self._jitted(self._leaves, x, *rest))

        return call

    def lower(self, *inputs: Any) -> Any:
        """`jax.jit(...).lower` of one call, for inspection (argument counts, HLO)."""
        return self._jitted.lower(self._leaves, *inputs)

    def load_state(self, model: nnx.Module) -> None:
        """Takes new weights (e.g. after `nnx.update`) without recompiling.

        Raises:
          ValueError: another structure, shape, dtype or placement than the program was built
            with (a different model needs a new program).
        """
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if graphdef != self.graphdef or treedef != self._treedef:
            raise ValueError("load_state needs a model of the same structure")
        if self._spec_of(leaves) != self._spec:
            raise ValueError(
                "load_state needs the same parameter shapes, dtypes and placements as the model "
                "the program was built with"
            )
        self._leaves = leaves


def run_layers(layers: Any, x: Any, *args: Any) -> Any:
    """`x = layer(x, *args)` for every layer of a `jaxsync.LayerStack` (one scan) or a list."""
    if callable(layers):
        return layers(x, *args)
    for layer in layers:
        x = layer(x, *args)
    return x
