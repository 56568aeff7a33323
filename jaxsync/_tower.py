"""One calling convention for every model path: a pure forward, and a compact compiled program.

A family writes its forward once, as a pure function of the NNX module:

    def forward(model, pixels, meta):                 # callable inside any jit / shard_map
        x, ctx = model.embed(pixels, meta)
        x = jaxsync.run_layers(model.blocks, x, ctx)  # a Python loop over the layers here
        return model.head(x, ctx, meta)

A server calls it inside its own jitted step with the module it owns (weights are arguments,
never constants). `TowerProgram(model, forward, layers="blocks")` compiles the same function
for the host entry point with the module's state packed into one buffer per dtype
(`jaxsync.PackedTower`) and its layers run as one `lax.scan`: the program takes
`1 + len(inputs)` arguments per dtype however deep the model (jit dispatch costs host time per
argument), and traces one layer instead of L. Inside that program `run_layers` sees the stacked
rows instead of the Python list, so the forward's code is shared, not copied.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync import _compat
from jaxsync._calls import deleted_message
from jaxsync._jit import flat_state
from jaxsync._layers import split_layers
from jaxsync._packing import PackedLeaves, PackedTower


# id(empty layer list of a merged shell) -> (layer_graphdef, rows, unpack), set while tracing
# a TowerProgram: lets the shared forward scan the packed rows where it names the layer list.
_SCANNED: contextvars.ContextVar[dict[int, tuple] | None] = contextvars.ContextVar(
    "jaxsync_scanned_layers", default=None
)


def run_layers(layers: Sequence[nnx.Module], x: Any, *args: Any) -> Any:
    """`x = layer(x, *args)` for every layer: a loop, or one scan inside a `TowerProgram`.

    Args:
      layers: the module's layer list (e.g. `model.blocks`), as the forward reads it.
      x: the carry (each layer returns the same shape and dtype).
      *args: per-call values every layer reads (masks, rotary tables), closed over.
    """
    scanned = (_SCANNED.get() or {}).get(id(layers))
    if scanned is None:
        for layer in layers:
            x = layer(x, *args)
        return x
    graphdef, steps, unpack = scanned

    def step(carry, i):
        return nnx.merge(graphdef, unpack(i))(carry, *args), None

    # Scanning layer indices over the whole buffer slices one row per step; scanning a slice
    # of the buffer would make XLA copy every layer's weights first. The per-step weight slice
    # is a copy too (about 5% of the voxtral encoder on an H200); neither storing the weights
    # as separate stacked arrays nor XLA's dynamic-slice fusion made the scan faster.
    out, _ = jax.lax.scan(step, x, jnp.arange(steps))
    return out


# XLA on a GPU autotunes every matmul over cuBLAS algorithms and its own Triton kernels. For the
# voxtral encoder at released width the Triton candidates never win, yet the program compiled
# with them off runs 3-5% faster on an H200 (other algorithms win the timing) and compiles in a
# third of the time. Other towers measured no better or slightly worse, so it is per program.
CUBLAS_MATMULS: dict[str, Any] = {"xla_gpu_enable_triton_gemm": False}


def jit_options(matmuls: str, platform: str | None, jit_kwargs: dict[str, Any]) -> dict:
    """`jit_kwargs` with `CUBLAS_MATMULS` added to its compiler options for "cublas" on a GPU
    (the caller's own options win)."""
    if matmuls != "cublas" or platform != "gpu":
        return jit_kwargs
    options = {**CUBLAS_MATMULS, **jit_kwargs.get("compiler_options", {})}
    return {**jit_kwargs, "compiler_options": options}


def _replicated(leaves: Sequence[jax.Array]) -> bool:
    shardings = {x.sharding for x in leaves}
    return len(shardings) == 1 and next(iter(shardings)).is_fully_replicated


class TowerProgram:
    """`forward(model, *inputs)` compiled with the model's state as a few packed buffers.

    Args:
      model: the NNX module (its arrays are snapshotted: see `load_state`).
      forward: the family's pure forward `forward(model, *inputs)`; it must run the layer list
        named by `layers` through `jaxsync.run_layers`.
      layers: attribute holding the list of identical layers, or None for a model without one
        (its leaves are then packed flat, one buffer per dtype).
      matmuls: "xla" (XLA picks each matmul's kernel) or "cublas": on a GPU, only cuBLAS
        algorithms are candidates for a matmul, no Triton kernel (see `CUBLAS_MATMULS`).
        Ignored on other platforms.
      **jit_kwargs: passed to `jax.jit` (e.g. `donate_argnums` counted over `inputs`, shifted
        by the one state argument).

    State that is sharded (split over a mesh axis) cannot be packed without resharding, so it
    is passed leaf by leaf instead (more jit arguments, same results).

    Attributes:
      num_state_args: jit arguments the state takes per call.
      platform: the platform the state lives on ("cpu", "gpu", "tpu").
      matmuls: the `matmuls` argument.
    """

    def __init__(
        self,
        model: nnx.Module,
        forward: Callable[..., Any],
        *,
        layers: str | None = "layers",
        matmuls: str = "xla",
        **jit_kwargs: Any,
    ):
        if matmuls not in ("xla", "cublas"):
            raise ValueError(f"matmuls must be 'xla' or 'cublas', got {matmuls!r}")
        self._forward = forward
        self._layers = layers
        self.matmuls = matmuls
        self._build(model)
        options = jit_options(matmuls, self.platform, jit_kwargs)
        self._top = jax.jit(self._run, **options)
        self._jitted = self._top
        if options is not jit_kwargs:
            # JAX takes compiler options only on a top-level jit: traced inside another jit (a
            # server's step, a checker), the program is the same function without them.
            nested = jax.jit(self._run, **jit_kwargs)
            top = self._top
            self._jitted = lambda *a: (nested if _compat.tracing() else top)(*a)

    def _build(self, model: nnx.Module) -> None:
        if self._layers is not None and len(getattr(model, self._layers)):
            graphdef, state, layer_graphdef, layer_state = split_layers(model, self._layers)
            own, merge = flat_state(graphdef, state)
            rows, layer_treedef = jax.tree_util.tree_flatten(layer_state)
        else:
            own, merge = flat_state(*nnx.split(model))
            rows, layer_graphdef, layer_treedef = [], None, None
        self._merge, self._num_own = merge, len(own)
        self._layer_graphdef, self._layer_treedef = layer_graphdef, layer_treedef
        leaves = own + rows
        self._pack = None
        if _replicated(leaves):
            self._pack = PackedTower(own, rows) if rows else PackedLeaves(own)
            self._args = self._pack.buffers
        else:
            self._args = leaves
        self.num_layers = int(rows[0].shape[0]) if rows else 0
        self.num_state_args = len(self._args)
        self._spec = [(x.shape, x.dtype, x.sharding) for x in leaves]
        self.platform = next(iter(leaves[0].sharding.device_set)).platform if leaves else None

    def _unpacked(self, args: Sequence[jax.Array]) -> tuple[list, Callable[[Any], Any]]:
        """(own leaves, unpack(i) -> layer i's state) inside the trace."""
        tree = lambda leaves: jax.tree_util.tree_unflatten(self._layer_treedef, leaves)  # noqa: E731
        if isinstance(self._pack, PackedTower):
            return self._pack.own(args), lambda i: tree(self._pack.layer(args, i))
        if isinstance(self._pack, PackedLeaves):
            return self._pack.unpack(args), None
        own, rows = list(args[: self._num_own]), list(args[self._num_own :])
        return own, lambda i: tree(
            [jax.lax.dynamic_index_in_dim(r, i, keepdims=False) for r in rows]
        )

    def _run(self, args: Sequence[jax.Array], *inputs: Any) -> Any:
        own, unpack = self._unpacked(args)
        model = self._merge(own)
        if not self.num_layers:
            return self._forward(model, *inputs)
        shell_layers = getattr(model, self._layers)
        scanned = {
            **(_SCANNED.get() or {}),
            id(shell_layers): (self._layer_graphdef, self.num_layers, unpack),
        }
        token = _SCANNED.set(scanned)
        try:
            return self._forward(model, *inputs)
        finally:
            _SCANNED.reset(token)

    def __call__(self, *inputs: Any) -> Any:
        """Runs the compiled forward on `inputs` (device arrays / `jaxsync.Packed`)."""
        return self._jitted(self._args, *inputs)

    def prepared(
        self, *rest: Any, finish: Callable[[Any], Any], name: str
    ) -> Callable[[jax.Array], Any]:
        """`x -> finish(self(x, *rest))`: an entry's kept call (see `jaxsync.CallCache`).

        Two Python frames between the entry and the dispatch: it runs right after the serving
        thread waited, when every frame costs microseconds. The weights are read at call time,
        so `load_state` is seen. A deleted `x` raises `ValueError` naming `name` (the program
        refuses it before any launch).
        """

        def call(x: jax.Array) -> Any:
            try:
                out = self._jitted(self._args, x, *rest)
            except RuntimeError:
                if not x.is_deleted():
                    raise
                raise ValueError(deleted_message(name)) from None
            return finish(out)

        return call

    def lower(self, *inputs: Any) -> Any:
        """`jax.jit(...).lower` of one call, for inspection (argument counts, HLO)."""
        return self._top.lower(self._args, *inputs)

    def load_state(self, model: nnx.Module) -> None:
        """Takes new weights (e.g. after `nnx.update`) without recompiling.

        The program holds a packed snapshot of the weights, so an update of the module is not
        seen until this is called. The new state must have the same structure, shapes, dtypes
        and placements, or `ValueError` is raised (a different model needs a new program).
        """
        before = dict(self.__dict__)
        self._build(model)
        if self._spec != before["_spec"]:
            self.__dict__.update(before)
            raise ValueError(
                "load_state needs the same parameter structure, shapes, dtypes and placements "
                "as the model the program was built with"
            )
