"""Jitting a method of an NNX module as a pure function of its state.

`nnx.jit` re-walks the module graph on every call. A serving hot path wants the graph split once:
`jit_method` keeps `(graphdef, state)` and calls one `jax.jit` function per call, so the per-call
host cost is a plain jit dispatch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx


def flat_state(
    graphdef: nnx.GraphDef, state: nnx.State
) -> tuple[list[jax.Array], Callable[[Sequence[jax.Array]], nnx.Module]]:
    """A module's state as a flat list of arrays, and `merge(leaves)` that rebuilds the module.

    Pass the list to `jax.jit` and call `merge` inside the traced function: jit flattens a list
    of arrays in C++, while an `nnx.State` argument is walked in Python on every call (about
    1 us per Variable warm, several times that cold).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> leaves, merge = flat_state(*nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))
    >>> jax.jit(lambda leaves, x: merge(leaves)(x))(leaves, jnp.ones((4, 2))).shape
    (4, 3)
    """
    leaves, treedef = jax.tree_util.tree_flatten(state)

    def merge(leaves: Sequence[jax.Array]) -> nnx.Module:
        return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))

    return leaves, merge


class JitMethod:
    """A jitted `module.method` with the module state as a hidden first argument.

    Args:
      module: the NNX module (its current state is captured; call `refresh()` after mutating it).
      method: the method name.
      **jit_kwargs: forwarded to `jax.jit`; `static_argnames`, `donate_argnames`, `static_argnums`
        and `donate_argnums` refer to the method's own arguments.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> f = JitMethod(lin)
    >>> f(jnp.ones((4, 2))).shape
    (4, 3)
    """

    def __init__(self, module: nnx.Module, method: str = "__call__", **jit_kwargs: Any):
        self.method = method
        self.graphdef, self.state = nnx.split(module)
        # The state goes to jit as a flat list of arrays, rebuilt only in the trace.
        self._leaves, merge = flat_state(self.graphdef, self.state)
        self._treedef = jax.tree_util.tree_structure(self.state)
        bound = getattr(module, method)

        def run(leaves, *args, **kwargs):
            return getattr(merge(leaves), method)(*args, **kwargs)

        sig = inspect.signature(bound)
        state_param = inspect.Parameter("_jaxsync_state", inspect.Parameter.POSITIONAL_ONLY)
        run.__signature__ = sig.replace(parameters=[state_param, *sig.parameters.values()])
        for key in ("static_argnums", "donate_argnums"):
            if key in jit_kwargs:
                nums = jit_kwargs[key]
                nums = (nums,) if isinstance(nums, int) else tuple(nums)
                jit_kwargs[key] = tuple(n + 1 for n in nums)
        self._jitted = jax.jit(run, **jit_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(self._leaves, *args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """`jax.jit(...).lower` with the captured state, for HLO inspection."""
        return self._jitted.lower(self._leaves, *args, **kwargs)

    def refresh(self, module: nnx.Module) -> None:
        """Takes a new state from `module` (same graph structure)."""
        self.state = nnx.state(module)
        leaves, treedef = jax.tree_util.tree_flatten(self.state)
        if treedef != self._treedef:
            raise ValueError("refresh() needs a module with the same graph structure")
        self._leaves = leaves

    @property
    def fn(self) -> Callable[..., Any]:
        """The underlying jitted function `(state_leaves, *args)`."""
        return self._jitted


def jit_method(module: nnx.Module, method: str = "__call__", **jit_kwargs: Any) -> JitMethod:
    """Shorthand for `JitMethod(module, method, **jit_kwargs)`."""
    return JitMethod(module, method, **jit_kwargs)
