"""Strict, streaming loading of Hugging Face safetensors checkpoints into NNX modules.

The module is built abstractly (`nnx.eval_shape`, nothing allocated). Then, from the shard headers
alone, every selected key is mapped through the rules and checked (stored shape before any
transform, dtype, placement), and every parameter is accounted for: all strictness errors are
raised before a byte of tensor data is read. Only then are the selected tensors read, shard by
shard, each transformed and placed on its device or sharding at once, so host memory peaks at
about the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsync.weights import _progress
from jaxsync.weights._checkpoint import (
    TensorInfo,
    WeightError,
    open_shard,
    read_tensor,
    selected_tensors,
)
from jaxsync.weights._placement import PartitionRules, Placement, ShardingFn, placement
from jaxsync.weights._rules import Rule, expected_stored_shape


@dataclasses.dataclass(frozen=True)
class _Load:
    """One checked tensor: where it goes and how it gets there."""

    info: TensorInfo
    variable: nnx.Variable
    transform: Callable | None
    cast: jnp.dtype | None
    place: Placement


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


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
        dotted path places it with `NamedSharding(mesh, PartitionSpec(*axes))`. Axis names the
        mesh lacks are ignored and a dimension the mesh axes do not divide is replicated, so one
        table serves any mesh. Without a mesh, parameters go to the default device.
      progress: draw a progress bar on stderr once the load has run for 2 s; None draws it only
        when stderr is a terminal.

    Returns:
      The module with every parameter loaded and placed.

    Raises:
      WeightError: before any tensor is read, for a selected key no rule matches, a target that
        is not a parameter, a key mapped twice, a parameter left unassigned, a stored shape the
        rule's transform does not expect, a dtype mismatch, a placement that does not fit, or an
        unreadable file (missing, truncated, bad header, an index naming a key its shard lacks).
    """
    abstract = nnx.eval_shape(factory)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    targets = {_path_str(p): p for p in flat}
    default = jax.config.jax_default_device or jax.devices()[0]
    cast_to = None if dtype is None else jnp.dtype(dtype)

    plan: list[_Load] = []
    assigned: dict[str, str] = {}
    for key, info in selected_tensors(checkpoint, select, strip).items():
        short = key[len(strip) :]
        rule, target = next(
            ((r, t) for r in rules if (t := r.match(short)) is not None), (None, None)
        )
        if rule is None:
            raise WeightError(f"checkpoint key {key!r} matches no mapping rule")
        if target not in targets:
            raise WeightError(f"checkpoint key {key!r} maps to {target!r}, not a module parameter")
        if target in assigned:
            raise WeightError(f"keys {assigned[target]!r} and {key!r} both map to {target!r}")
        variable = flat[targets[target]]
        expected = variable.get_value()
        out_dtype = _check_shape(info, rule, target, expected)
        cast = _cast(info, target, out_dtype, expected.dtype, cast_to, allow_cast)
        place = placement(
            target,
            tuple(expected.shape),
            sharding=sharding,
            mesh=mesh,
            partition_rules=partition_rules,
            default=default,
        )
        plan.append(_Load(info, variable, rule.transform, cast, place))
        assigned[target] = key
    _check_complete(flat, targets, assigned)

    bar = _progress.Progress(sum(item.info.nbytes for item in plan), progress)
    try:
        for file in dict.fromkeys(item.info.file for item in plan):
            with open_shard(file) as handle:
                for item in (i for i in plan if i.info.file == file):
                    _place(item, read_tensor(handle, item.info))
                    bar.update(item.info.nbytes)
    finally:
        bar.close()
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place(item: _Load, value: jax.Array) -> None:
    """Transforms and casts one tensor on the host CPU device and places it; the host copies go
    when this returns, before the next tensor is read."""
    if item.transform is not None:
        value = item.transform(value)
    if item.cast is not None:
        value = value.astype(item.cast)
    item.variable.set_value(jax.device_put(value, item.place))


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
        out = jax.eval_shape(rule.transform, jax.ShapeDtypeStruct(info.shape, info.dtype))
    except Exception as e:  # any failure of the user's transform on this shape is a misfit
        raise WeightError(f"{where}: transform fails on stored shape {info.shape}: {e}") from e
    if tuple(out.shape) != want:
        raise WeightError(
            f"{where}: shape {tuple(out.shape)} (after transform of stored {info.shape}) but "
            f"the module expects {want}"
        )
    return out.dtype


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


def _check_complete(flat: dict, targets: dict[str, Any], assigned: dict[str, str]) -> None:
    missing = [t for t in targets if t not in assigned and isinstance(flat[targets[t]], nnx.Param)]
    if missing:
        raise WeightError(f"{len(missing)} parameter(s) not in the checkpoint: {missing[:8]}")
    for t in targets:  # non-parameter state (e.g. buffers computed in __init__) is materialised
        if t not in assigned and isinstance(flat[targets[t]].get_value(), jax.ShapeDtypeStruct):
            raise WeightError(
                f"state {t!r} is not a parameter and not in the checkpoint; derive such constants "
                "from the config (numpy / DeviceCache) instead of storing them as nnx state"
            )


def to_numpy_state(module: nnx.Module) -> dict[str, np.ndarray]:
    """Flat `{dotted path: array}` of a module's parameters (host copies; for tests and tools)."""
    _, state = nnx.split(module, nnx.Param)
    return {_path_str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
