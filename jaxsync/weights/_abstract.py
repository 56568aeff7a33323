"""The abstract module of a factory (`nnx.eval_shape`), built once per factory and config.

A factory is keyed only by values compared by value (frozen configs, scalars, dtypes, library
modules and functions) and JAX's x64 setting: repeated loads of one tower class and config skip
tracing its constructor, and a factory whose structure could change between loads (a mutable
config, a user module attribute, a user function) is traced on every load.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx


_ABSTRACT: dict[Any, nnx.Module] = {}  # factory key -> its module under `nnx.eval_shape`


_STABLE_MODULES = frozenset({"jax", "jaxlib", "flax", "numpy", "ml_dtypes", "jaxsync", "builtins"})


def _by_value(value: Any) -> bool:
    """Whether `value` can key a cached structure: equal keys mean equal structure. Scalars,
    classes, dtypes, frozen dataclasses and tuples of such; modules and functions of the
    libraries the towers are built from. A mutable object hashed by identity (a config mutated
    between loads), a user module (an attribute reassigned between loads) or a user function
    (it may read either) is not: such a factory is traced on every load."""
    if value is None or isinstance(value, str | bytes | int | float | complex | bool | type):
        return True
    if isinstance(value, np.dtype):
        return True
    if isinstance(value, types.ModuleType):
        return value.__name__.partition(".")[0] in _STABLE_MODULES
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType):  # may read mutable state
        return (getattr(value, "__module__", None) or "").partition(".")[0] in _STABLE_MODULES
    if isinstance(value, tuple | frozenset):
        return all(_by_value(v) for v in value)
    if isinstance(value, dict):  # a config's table field, hashed by its items
        return all(_by_value(item) for item in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(type(value), "__dataclass_params__", None)
        return bool(params and params.frozen) and all(
            _by_value(getattr(value, f.name)) for f in dataclasses.fields(value)
        )
    return False


def _factory_key(factory: Callable) -> Any:
    """What determines `factory()`'s structure: a class, a `functools.partial`'s function and
    arguments, or a function's code with the values it closes over, its defaults and the
    globals it names, plus JAX's dtype setting; None (not cached) when any of them is not
    compared by value (`_by_value`)."""
    if isinstance(factory, type):
        key: Any = factory
        parts: tuple = ()
    elif isinstance(factory, functools.partial):
        key = (_factory_key(factory.func), factory.args, tuple(sorted(factory.keywords.items())))
        if key[0] is None:
            return None
        parts = key[1:]
    elif isinstance(factory, types.FunctionType):
        code, env = factory.__code__, factory.__globals__
        cells = tuple(c.cell_contents for c in factory.__closure__ or ())
        named = tuple((n, env[n]) for n in code.co_names if n in env)
        kwdefaults = tuple(sorted((factory.__kwdefaults__ or {}).items()))
        key = (code, cells, factory.__defaults__, kwdefaults, named)
        parts = key[1:]
    else:
        return None
    if not _by_value(parts):
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return key, bool(jax.config.jax_enable_x64)


def abstract_module(factory: Callable[[], nnx.Module]) -> nnx.Module:
    """`nnx.eval_shape(factory)`, built once per factory (see `_factory_key`): repeated loads of
    one tower class and config skip tracing its constructor. Each load gets its own copy
    (`nnx.clone`): loading fills the variables it is given, never the cached module's."""
    key = _factory_key(factory)
    if key is None:
        return nnx.eval_shape(factory)
    if key not in _ABSTRACT:
        if len(_ABSTRACT) >= 64:
            _ABSTRACT.pop(next(iter(_ABSTRACT)))
        _ABSTRACT[key] = nnx.eval_shape(factory)
    return nnx.clone(_ABSTRACT[key])
