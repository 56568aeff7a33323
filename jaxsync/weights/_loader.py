"""Strict, streaming loading of Hugging Face safetensors checkpoints into NNX modules.

The module is built abstractly (`nnx.eval_shape`, nothing allocated). Then, from the shard headers
alone, every selected key is mapped through the rules and checked (stored shape before any
transform, dtype, placement), and every parameter is accounted for: all strictness errors are
raised before a byte of tensor data is read. Only then are the selected tensors read, shard by
shard, each transformed and placed on its device or sharding at once, so host memory peaks at
about the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsync._stack import stacks
from jaxsync.weights import _progress
from jaxsync.weights._checkpoint import (
    TensorInfo,
    WeightError,
    host_buffer,
    open_shard,
    read_slice,
    read_tensor,
    selected_tensors,
)
from jaxsync.weights._placement import PartitionRules, Placement, ShardingFn, placement
from jaxsync.weights._rules import Rule, expected_stored_shape
from jaxsync.weights._sliced import BlockReader, LoadStats, sharded_array, splits_reading


_last_stats: LoadStats | None = None


def last_load_stats() -> LoadStats | None:
    """What the last `load_weights` call of this process read (bytes, tensors, parameters read
    by blocks); None before the first load."""
    return _last_stats


@dataclasses.dataclass(frozen=True)
class _Load:
    """One checked tensor: where it goes and how it gets there."""

    info: TensorInfo
    target: str  # the parameter's dotted path
    # where it goes in the parameter: (layer,) of a stacked (`jaxsync.LayerStack`) parameter,
    # (row,) of a parameter grouping tensors along its first axis, (layer, row), or () for all
    index: tuple[int, ...]
    transform: Callable | None
    cast: jnp.dtype | None


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def _stacked_slot(target: str, stacked: dict[str, int]) -> tuple[str, int | None]:
    """`blocks.3.attn.qkv.kernel` -> (`blocks.layer.attn.qkv.kernel`, 3) when `blocks` is a
    `jaxsync.LayerStack`; other targets unchanged, with no layer."""
    for prefix, num_layers in stacked.items():
        head = prefix + "."
        if not target.startswith(head):
            continue
        index, _, rest = target[len(head) :].partition(".")
        if index.isdigit() and rest:
            if int(index) >= num_layers:
                raise WeightError(
                    f"{target!r} names layer {index} of {prefix!r}, which has {num_layers} layers"
                )
            return f"{head}layer.{rest}", int(index)
    return target, None


def _row_slot(target: str, targets: dict[str, Any]) -> tuple[str, int | None]:
    """`norms.vectors.2` -> (`norms.vectors`, 2) when `norms.vectors` is a parameter (a group of
    equal-shape tensors along its first axis) and `norms.vectors.2` is not; else no row."""
    head, _, row = target.rpartition(".")
    if target in targets or not row.isdigit() or head not in targets:
        return target, None
    return head, int(row)


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


def load_weights(
    factory: Callable[[], nnx.Module],
    checkpoint: str | Path,
    rules: Sequence[Rule],
    *,
    select: str | None = None,
    strip: str = "",
    dtype: Any = None,
    allow_cast: bool = False,
    sharding: ShardingFn | None = None,
    mesh: Mesh | None = None,
    partition_rules: PartitionRules | None = None,
    progress: bool | None = None,
) -> nnx.Module:
    """Builds `factory()` abstractly and fills every parameter from `checkpoint`.

    Dtype policy: `dtype=None` casts nothing, so each tensor's checkpoint dtype must be its
    parameter's (build the module at `checkpoint_dtype(...)`); an explicit `dtype` casts every
    float tensor to it and stores it so. `allow_cast=True` (legacy) casts floats to each
    parameter's declared dtype.

    Layers stored stacked (`jaxsync.LayerStack` at path `blocks`) take the checkpoint's per-layer
    keys: a rule target `blocks.3.attn.kernel` fills slice 3 of `blocks.layer.attn.kernel`. A
    stacked parameter is assembled on the host from its L slices and placed once, so host memory
    peaks at about one stacked parameter; other tensors are placed as they are read. Transforms
    and casts run in numpy on the host: no device program is compiled per tensor.

    A parameter may group several tensors of one shape along its first axis (a layer's norm
    scales and biases as one `[k, C]` parameter): a rule target `norm.vectors.2` (a parameter
    `norm.vectors` and a row index) fills row 2, `blocks.3.norm.vectors.2` row 2 of layer 3.

    Under `jax.distributed`, a parameter whose sharding spans devices of other processes is
    built with `jax.make_array_from_callback` from the blocks this process's devices hold: each
    distinct block is read alone (`get_slice(key)[index]`), its index mapped back through the
    rule's transform when that is an axis permutation (`linear`, `conv`, `transpose`, their
    compositions), or through a transform that gathers rows per axis (a head-major reorder, GLU
    pairs; see `_sliced.gather_map`) to the stored rows the block takes. A tensor whose
    transform maps no index (arithmetic, a change of rank) is read whole in each process and
    sliced after its transform. `last_load_stats()` reports the bytes
    read. Parameters this process's devices hold whole (every single-process load) are read
    whole and placed with one `jax.device_put`.

    Args:
      factory: zero-argument callable building the module (run under `nnx.eval_shape`).
      checkpoint: a `.safetensors` file, a sharded `*.index.json`, or a directory.
      rules: the key mapping; the first rule that matches a key wins.
      select: regex; only keys with `re.match(select, key)` are loaded, the rest belong to other
        modules, are ignored and never read (nor their shards opened, given an index). None
        selects every key.
      strip: prefix removed from selected keys before matching rules.
      dtype: None, or the float dtype to cast float tensors to (see the policy above).
      allow_cast: cast float tensors to each parameter's declared dtype.
      sharding: optional `(param_path, shape) -> Sharding | None` placement per parameter; it
        takes precedence over `partition_rules`.
      mesh: with `partition_rules`, the mesh parameters are sharded over; parameters no rule
        matches are replicated over it.
      partition_rules: `[(regex, axes), ...]`; the first regex that `re.search`es a parameter's
        dotted path places it with `NamedSharding(mesh, PartitionSpec(*axes))`. For a stacked
        parameter the axes describe one layer and the layer axis is prepended unsharded. Axis
        names the mesh lacks are ignored and a dimension the mesh axes do not divide is
        replicated, so one table serves any mesh. Without a mesh, parameters go to the default
        device.
      progress: draw a progress bar on stderr once the load has run for 2 s; None draws it only
        when stderr is a terminal.

    Returns:
      The module with every parameter loaded and placed.

    Raises:
      WeightError: before any tensor is read, for a selected key no rule matches, a target that
        is not a parameter, a key mapped twice, a parameter (or a layer of a stacked one) left
        unassigned, a stored shape the rule's transform does not expect, a dtype mismatch, a
        placement that does not fit, or an unreadable file (missing, truncated, bad header, an
        index naming a key its shard lacks).
    """
    abstract = abstract_module(factory)
    stacked = stacks(abstract)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    targets = {_path_str(p): p for p in flat}
    default = jax.config.jax_default_device or jax.devices()[0]
    cast_to = None if dtype is None else jnp.dtype(dtype)

    groups: dict[str, list[_Load]] = {}  # parameter -> its tensors (one, or one per layer)
    places: dict[str, Placement] = {}
    assigned: dict[tuple[str, int | None], str] = {}
    for key, info in selected_tensors(checkpoint, select, strip).items():
        short = key[len(strip) :]
        rule, mapped = next(
            ((r, t) for r in rules if (t := r.match(short)) is not None), (None, None)
        )
        if rule is None:
            raise WeightError(f"checkpoint key {key!r} matches no mapping rule")
        target, layer = _stacked_slot(mapped, stacked)
        target, row = _row_slot(target, targets)
        index = tuple(i for i in (layer, row) if i is not None)
        if target not in targets:
            raise WeightError(f"checkpoint key {key!r} maps to {mapped!r}, not a module parameter")
        if (target, index) in assigned:
            raise WeightError(
                f"keys {assigned[target, index]!r} and {key!r} both map to {mapped!r}"
            )
        expected = flat[targets[target]].get_value()
        if target in groups and len(index) != len(groups[target][0].index):
            raise WeightError(
                f"key {key!r} maps to {mapped!r}, which another key fills "
                + ("whole" if not groups[target][0].index else "by another slicing")
            )
        if row is not None and len(expected.shape) <= len(index):
            raise WeightError(f"checkpoint key {key!r} maps to {mapped!r}, not a module parameter")
        layer_shape = tuple(expected.shape[len(index) :])
        out_dtype = _check_shape(
            info, rule, mapped, jax.ShapeDtypeStruct(layer_shape, expected.dtype)
        )
        cast = _cast(info, mapped, out_dtype, expected.dtype, cast_to, allow_cast)
        if target not in places:
            places[target] = _placement_of(
                target,
                tuple(expected.shape),
                layer is not None,
                sharding,
                mesh,
                partition_rules,
                default,
            )
        groups.setdefault(target, []).append(_Load(info, target, index, rule.transform, cast))
        assigned[target, index] = key
    for prefix, num_layers in stacked.items():  # a stack of no layers reads nothing
        for target in targets:
            if not num_layers and target.startswith(prefix + ".layer."):
                expected = flat[targets[target]].get_value()
                empty = np.zeros(expected.shape, expected.dtype)
                flat[targets[target]].set_value(
                    jax.device_put(
                        empty,
                        _placement_of(
                            target, expected.shape, True, sharding, mesh, partition_rules, default
                        ),
                    )
                )
                assigned[target, ()] = "(no layers)"
    _check_complete(flat, targets, assigned, stacked)

    total = sum(i.info.nbytes for g in groups.values() for i in g)
    stats = LoadStats(selected_bytes=total)
    bar = _progress.Progress(total, progress)
    try:
        with contextlib.ExitStack() as files:
            handles: dict[Path, Any] = {}

            def handle(item: _Load) -> Any:
                if item.info.file not in handles:
                    handles[item.info.file] = files.enter_context(open_shard(item.info.file))
                return handles[item.info.file]

            def read_block(
                item: _Load, index: tuple[slice, ...] | None, out: np.ndarray | None = None
            ) -> np.ndarray:
                """One tensor (index None) or one block of it, transformed and cast; a tensor
                kept as stored is read straight into `out` when one is given."""
                if index is None:
                    kept = item.transform is None and item.cast is None
                    raw = read_tensor(handle(item), item.info, out=out if kept else None)
                else:
                    raw = read_slice(handle(item), item.info, index)
                stats.bytes_read += raw.nbytes
                stats.tensors += 1
                return _host_value(item, raw)

            def read(item: _Load, out: np.ndarray | None = None) -> np.ndarray:
                value = read_block(item, None, out)
                bar.update(item.info.nbytes)
                return value

            for target, items in groups.items():
                variable = flat[targets[target]]
                if splits_reading(places[target]):  # this process reads only its own blocks
                    expected = variable.get_value()
                    reader = BlockReader(items, tuple(expected.shape), read_block)
                    (stats.sliced if reader.mapped else stats.whole).append(target)
                    value = sharded_array(reader, places[target], expected.dtype)
                    variable.set_value(value)
                    for item in items:  # the bar follows the checkpoint, not the bytes read
                        bar.update(item.info.nbytes)
                    continue
                if not items[0].index:
                    host = read(items[0])
                else:  # one host buffer for the L slices (or rows), placed once
                    expected = variable.get_value()
                    host = host_buffer(expected.shape, expected.dtype)
                    for item in sorted(items, key=lambda i: (str(i.info.file), i.index)):
                        slot = host[item.index]  # read into in place (the kernel fills it)
                        if (value := read(item, slot)) is not slot:
                            slot[...] = value
                variable.set_value(jax.device_put(host, places[target]))
                del host
    finally:
        bar.close()
        global _last_stats
        _last_stats = stats
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _host_value(item: _Load, value: Any) -> np.ndarray:
    """One tensor transformed and cast in numpy on the host (no device program per tensor)."""
    value = np.asarray(value)
    if item.transform is not None:
        value = np.asarray(item.transform(value))
    if item.cast is not None:
        value = value.astype(item.cast)
    return value


def _placement_of(
    target: str,
    shape: tuple[int, ...],
    layered: bool,
    sharding: ShardingFn | None,
    mesh: Mesh | None,
    partition_rules: PartitionRules | None,
    default: jax.Device,
) -> Placement:
    """Where parameter `target` goes; a stacked one is placed by its rule for one layer, with
    the layer axis unsharded in front."""
    if not layered:
        return placement(
            target,
            shape,
            sharding=sharding,
            mesh=mesh,
            partition_rules=partition_rules,
            default=default,
        )
    if sharding is not None and (chosen := sharding(target, shape)) is not None:
        return placement(
            target,
            shape,
            sharding=lambda *_: chosen,
            mesh=None,
            partition_rules=None,
            default=default,
        )
    layer = placement(
        target,
        shape[1:],
        sharding=None,
        mesh=mesh,
        partition_rules=partition_rules,
        default=default,
    )
    if isinstance(layer, NamedSharding):
        return NamedSharding(layer.mesh, PartitionSpec(None, *layer.spec))
    return layer


def _check_shape(info: TensorInfo, rule: Rule, target: str, expected: Any) -> jnp.dtype:
    """Checks the stored shape against what the transform expects, then the transform's result
    (abstractly: nothing is read); returns the dtype after the transform."""
    where = f"checkpoint key {info.key!r} in {info.file.name} -> {target!r}"
    want = tuple(expected.shape)
    try:
        stored = expected_stored_shape(rule.transform, want)
    except ValueError as e:
        raise WeightError(f"{where}: {e}") from None
    if stored is not None and info.shape != stored:
        via = f" through {rule.transform!r}" if rule.transform is not None else ""
        raise WeightError(
            f"{where}: stored shape {info.shape}, but the module's {want}{via} expects "
            f"stored shape {stored}"
        )
    if rule.transform is None:
        return info.dtype
    # Also the forward map: the only check for a transform without an inverse shape map, and a
    # guard against a custom inverse map that disagrees with its transform.
    try:
        out = _forward_shape(rule.transform, info.shape, info.dtype)
    except Exception as e:  # any failure of the user's transform on this shape is a misfit
        raise WeightError(f"{where}: transform fails on stored shape {info.shape}: {e}") from e
    if tuple(out.shape) != want:
        raise WeightError(
            f"{where}: shape {tuple(out.shape)} (after transform of stored {info.shape}) but "
            f"the module expects {want}"
        )
    return out.dtype


@functools.lru_cache(maxsize=4096)
def _traced_shape(transform: Callable, shape: tuple[int, ...], dtype: Any) -> Any:
    return jax.eval_shape(transform, jax.ShapeDtypeStruct(shape, dtype))


def _forward_shape(transform: Callable, shape: tuple[int, ...], dtype: Any) -> Any:
    """The transform's result shape and dtype, traced once per (transform, stored shape, dtype):
    one rule serves every layer of a tower."""
    try:
        hash(transform)
    except TypeError:
        return jax.eval_shape(transform, jax.ShapeDtypeStruct(shape, dtype))
    return _traced_shape(transform, shape, dtype)


def _cast(
    info: TensorInfo,
    target: str,
    got: jnp.dtype,
    want: jnp.dtype,
    cast_to: jnp.dtype | None,
    allow_cast: bool,
) -> jnp.dtype | None:
    """The dtype to cast to (None: none), per the policy in `load_weights`."""
    floats = jnp.issubdtype(got, jnp.floating) and jnp.issubdtype(want, jnp.floating)
    if floats and cast_to is not None:
        return None if got == cast_to else cast_to
    if got == want:
        return None
    if floats and allow_cast:
        return want
    hint = " (pass dtype= to cast floats, or build the module at checkpoint_dtype)" * floats
    raise WeightError(
        f"checkpoint key {info.key!r} -> {target!r}: dtype {got} but the module expects "
        f"{want}{hint}"
    )


def _check_complete(
    flat: dict,
    targets: dict[str, Any],
    assigned: dict[tuple[str, tuple[int, ...]], str],
    stacked: dict,
) -> None:
    filled = {t for t, _ in assigned}
    missing = [t for t in targets if t not in filled and isinstance(flat[targets[t]], nnx.Param)]
    if missing:
        raise WeightError(f"{len(missing)} parameter(s) not in the checkpoint: {missing[:8]}")
    for t in filled:
        parts = {i for u, i in assigned if u == t and i}
        if parts:
            lead = flat[targets[t]].get_value().shape[: len(next(iter(parts)))]
            gaps = sorted(set(itertools.product(*map(range, lead))) - parts)
            if gaps and any(t.startswith(p + ".layer.") for p in stacked) and len(lead) == 1:
                raise WeightError(
                    f"{len(gaps)} layer(s) of stacked parameter {t!r} not in the checkpoint: "
                    f"layers {[g[0] for g in gaps[:8]]}"
                )
            if gaps:
                raise WeightError(
                    f"{len(gaps)} slice(s) of parameter {t!r} not in the checkpoint: "
                    f"{[g if len(g) > 1 else g[0] for g in gaps[:8]]}"
                )
    for t in targets:  # non-parameter state (e.g. buffers computed in __init__) is materialised
        if t not in filled and isinstance(flat[targets[t]].get_value(), jax.ShapeDtypeStruct):
            raise WeightError(
                f"state {t!r} is not a parameter and not in the checkpoint; derive such constants "
                "from the config (numpy / DeviceCache) instead of storing them as nnx state"
            )


def to_numpy_state(module: nnx.Module) -> dict[str, np.ndarray]:
    """Flat `{dotted path: array}` of a module's parameters (host copies; for tests and tools)."""
    _, state = nnx.split(module, nnx.Param)
    return {_path_str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
