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

`packed=True` (the entries' default) hands the same forward the same weights in fewer arguments:
a state on one placement is packed into one flat buffer per dtype, and each `LayerStack` into
one `[L, S]` row buffer per dtype, whose scan reads layer i's row (`PackedStack`). jit dispatch
costs host time per argument, so the packed entry dispatches 4-11 arguments where the stacked
leaves are 20-40; device time is the same (both scans slice by an opaque layer index, see
`jaxsync._stack.scan_indices`). `jaxsync bench` measures both forms side by side. The
forward's code is the same: the stack it calls is a `PackedStack` in the program's trace and a
`LayerStack` in a server's, two implementations of one scan. A sharded state is never packed
(that would reshard it).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxsync._calls import deleted_message
from jaxsync._packing import PackedLeaves
from jaxsync._stack import LayerStack, check_span, scan_indices


_SHARED: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()
_MAX_SHARED = 64


class PackedStack(nnx.Module):
    """A `LayerStack` inside a packed program: its layers' leaves are the rows of one `[L, S]`
    buffer per dtype, and its scan reads row i per step (no slice of the buffer is copied).

    A module like the stack it stands for, so code that walks the model inside the forward
    (`nnx.state`, a sharding lookup) sees its buffers as ordinary state."""

    def __init__(self, stack: _StackPacking, buffers: list[jax.Array]):
        self._stack = stack
        self.rows = nnx.List([nnx.Variable(b) for b in buffers])
        self.num_layers = stack.num_layers

    def __len__(self) -> int:
        return self.num_layers

    def _layer(self, i: jax.Array | int) -> nnx.Module:
        rows = [jax.lax.dynamic_index_in_dim(b[...], i, 0, keepdims=False) for b in self.rows]
        leaves = self._stack.rows.unpack(rows)
        layer_state = jax.tree_util.tree_unflatten(self._stack.treedef, leaves)
        return nnx.merge(self._stack.graphdef, layer_state)

    def __call__(self, x: Any, *args: Any, span: tuple[int, int] | None = None) -> Any:
        start, stop = (0, self.num_layers) if span is None else check_span(span, self.num_layers)
        return scan_indices(self._layer, x, args, start, stop)

    def at(self, i: int) -> nnx.Module:
        return self._layer(i)


class _StackSlot(nnx.Module):
    """Where a `LayerStack` sits in the packed program's module until its `PackedStack` does."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers


class _StackPacking:
    """One stack's layout in the packed program: its layer structure and row packing."""

    def __init__(self, path: tuple, stack: LayerStack):
        self.path, self.num_layers = path, stack.num_layers
        self.graphdef, state = nnx.split(stack.layer)
        leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self.rows = PackedLeaves(leaves, rows=True) if leaves else None
        self.buffers = [] if self.rows is None else self.rows.buffers
        if self.rows is not None:
            self.rows.buffers = []  # the program holds them, not the layout


class _Packing:
    """A module's state as few buffers: the non-stack leaves flat, each stack in rows."""

    def __init__(self, model: nnx.Module):
        # a stack of no layers has no rows: its empty leaves stay with the flat ones
        found = [
            (p, n) for p, n in nnx.iter_graph(model) if isinstance(n, LayerStack) and n.num_layers
        ]
        self.stacks = [_StackPacking(tuple(p), n) for p, n in found]
        shell = nnx.merge(*nnx.split(model))  # new Variables over the same arrays: no copy
        for st in self.stacks:
            _set(shell, st.path, _StackSlot(st.num_layers))
        self.graphdef, state = nnx.split(shell)
        own, self.treedef = jax.tree_util.tree_flatten(state)
        self.own = PackedLeaves(own) if own else None
        self.buffers = [list(self.own.buffers) if own else []]
        self.buffers += [st.buffers for st in self.stacks]
        if self.own is not None:
            self.own.buffers = []
        for st in self.stacks:
            st.buffers = []

    def merge(self, buffers: list[list[jax.Array]]) -> nnx.Module:
        """The module inside the trace, each stack a `PackedStack` over its row buffers."""
        own = self.own.unpack(buffers[0]) if self.own is not None else []
        model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, own))
        for st, rows in zip(self.stacks, buffers[1:], strict=True):
            _set(model, st.path, PackedStack(st, rows))
        return model


def _set(root: Any, path: tuple, value: Any) -> None:
    """`root.<path> = value` for a module path from `nnx.iter_graph` (names and list indices)."""
    parent = root
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _replicated(leaves: Sequence[jax.Array]) -> bool:
    shardings = {x.sharding for x in leaves}
    return len(shardings) == 1 and next(iter(shardings)).is_fully_replicated


def _shared_jit(
    forward: Callable[..., Any],
    graphdef: nnx.GraphDef,
    treedef: Any,
    jit_kwargs: dict[str, Any],
    packing: _Packing | None = None,
    spec: Any = None,
) -> Callable[..., Any]:
    """The jitted `(state, *inputs) -> forward(module, *inputs)` of this structure: the state
    as the flat leaves, or as the buffers of `packing` (made from leaves of shapes `spec`)."""
    options = tuple(sorted(jit_kwargs.items(), key=lambda kv: kv[0]))
    key = (forward, graphdef, treedef, options, None if packing is None else spec)
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

    def run_packed(buffers: list[list[jax.Array]], *inputs: Any) -> Any:
        return forward(packing.merge(buffers), *inputs)

    if packing is not None:
        run = run_packed

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
      packed: pass a state on one placement as packed buffers (see the module docstring); a
        sharded state is passed leaf by leaf either way. False passes the flat leaves, exactly
        the server form's arguments.
      **jit_kwargs: passed to `jax.jit` (e.g. `donate_argnums`, counted over `inputs` shifted
        by the one state argument).

    Attributes:
      num_state_args: jit arguments the state takes per call (its leaf count, or its buffers).
      packed: whether the state is passed packed.
      platform: the platform the state lives on ("cpu", "gpu", "tpu"), or None without state.
      graphdef: the module's structure.
    """

    def __init__(
        self,
        model: nnx.Module,
        forward: Callable[..., Any],
        *,
        packed: bool = True,
        **jit_kwargs: Any,
    ):
        self._forward, self._jit_kwargs = forward, jit_kwargs
        self.graphdef, state = nnx.split(model)
        leaves, self._treedef = jax.tree_util.tree_flatten(state)
        self._spec = self._spec_of(leaves)
        self.packed = bool(packed) and bool(leaves) and _replicated(leaves)
        self._take(model, leaves)
        device = next(iter(leaves[0].sharding.device_set)) if leaves else None
        self.platform = None if device is None else device.platform

    def _take(self, model: nnx.Module, leaves: list[jax.Array]) -> None:
        """This model's weights as the program's first argument."""
        jit_kwargs = dict(self._jit_kwargs)
        devices = {d for x in leaves for d in x.sharding.device_set}
        if len(devices) == 1 and "in_shardings" not in jit_kwargs:
            # jit keys its compiled programs by whether each argument is committed to a device
            # (`device_put(x, device)`, a staged upload) or not (`device_put(x)`, a result of
            # uncommitted inputs): a program declared on the weights' device compiles once for
            # both, so `precompile` covers every input a caller may hand in.
            jit_kwargs["in_shardings"] = jax.sharding.SingleDeviceSharding(devices.pop())
        if self.packed:
            packing = _Packing(model)
            self._leaves = packing.buffers
            spec = tuple((x.shape, x.dtype) for x in leaves)
            self._jitted = _shared_jit(
                self._forward, self.graphdef, self._treedef, jit_kwargs, packing, spec
            )
        else:
            self._leaves = leaves
            self._jitted = _shared_jit(self._forward, self.graphdef, self._treedef, jit_kwargs)
        self.num_state_args = len(jax.tree_util.tree_leaves(self._leaves))

    @staticmethod
    def _spec_of(leaves: Sequence[jax.Array]) -> list[tuple[Any, Any, Any]]:
        return [(x.shape, x.dtype, x.sharding) for x in leaves]

    @property
    def leaves(self) -> list[jax.Array]:
        """The state as the program takes it (its first argument): the leaves, or the packed
        buffers."""
        return self._leaves

    def __call__(self, *inputs: Any) -> Any:
        """Runs the compiled forward on `inputs` (device arrays / `jaxsync.Packed`)."""
        return self._jitted(self._leaves, *inputs)

    def prepared(
        self, *rest: Any, finish: Callable[[Any], Any], name: str
    ) -> Callable[[jax.Array], Any]:
        """`x -> finish(self(x, *rest))`: an entry's kept call (see `jaxsync._calls.CallCache`).

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
        self._take(model, leaves)
