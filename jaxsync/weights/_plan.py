"""From the shard headers alone, where each selected checkpoint tensor goes and whether it fits.

Every selected key is mapped through the rules to a parameter (or a layer of a stacked parameter,
or a row of one grouping tensors along its first axis), its stored shape checked against the
rule's transform, its dtype against the parameter's, and its placement chosen; every parameter
must be accounted for. All of it is decided before a byte of tensor data is read, so every
strictness error is raised first.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsync._stack import stacks
from jaxsync.weights._checkpoint import TensorInfo, WeightError, selected_tensors
from jaxsync.weights._placement import PartitionRules, Placement, ShardingFn, param_placement
from jaxsync.weights._rules import Rule, expected_stored_shape


@dataclasses.dataclass(frozen=True)
class TensorLoad:
    """One checked tensor: where it goes and how it gets there."""

    info: TensorInfo
    target: str  # the parameter's dotted path
    # where it goes in the parameter: (layer,) of a stacked (`jaxsync.LayerStack`) parameter,
    # (row,) of a parameter grouping tensors along its first axis, (layer, row), or () for all
    index: tuple[int, ...]
    transform: Callable | None
    cast: jnp.dtype | None


@dataclasses.dataclass
class LoadPlan:
    """A checked load: the module's flat state, and per parameter its tensors and placement.

    Attributes:
      graphdef: the abstract module's graph definition (merged with `flat` at the end).
      flat: `{path tuple: variable}` of the abstract module, filled as parameters are placed.
      targets: `{dotted path: path tuple}` of every variable.
      groups: parameter -> its tensors (one, or one per layer or row), in checkpoint order.
      places: parameter -> its sharding or device.
    """

    graphdef: Any
    flat: dict
    targets: dict[str, Any]
    groups: dict[str, list[TensorLoad]]
    places: dict[str, Placement]


def path_str(path: Sequence[Any]) -> str:
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


def plan_load(
    abstract: nnx.Module,
    checkpoint: str | Path,
    rules: Sequence[Rule],
    *,
    select: str | None,
    strip: str,
    dtype: Any,
    allow_cast: bool,
    sharding: ShardingFn | None,
    mesh: Mesh | None,
    partition_rules: PartitionRules | None,
) -> LoadPlan:
    """Maps and checks every selected tensor of `checkpoint` onto `abstract` (see
    `load_weights`), from the headers alone; a stack of no layers is placed here (empty)."""
    stacked = stacks(abstract)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    targets = {path_str(p): p for p in flat}
    default = jax.config.jax_default_device or jax.devices()[0]
    cast_to = None if dtype is None else jnp.dtype(dtype)

    groups: dict[str, list[TensorLoad]] = {}
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
            places[target] = param_placement(
                target,
                tuple(expected.shape),
                layer is not None,
                sharding,
                mesh,
                partition_rules,
                default,
            )
        groups.setdefault(target, []).append(TensorLoad(info, target, index, rule.transform, cast))
        assigned[target, index] = key
    for prefix, num_layers in stacked.items():  # a stack of no layers reads nothing
        for target in targets:
            if not num_layers and target.startswith(prefix + ".layer."):
                expected = flat[targets[target]].get_value()
                empty = np.zeros(expected.shape, expected.dtype)
                flat[targets[target]].set_value(
                    jax.device_put(
                        empty,
                        param_placement(
                            target, expected.shape, True, sharding, mesh, partition_rules, default
                        ),
                    )
                )
                assigned[target, ()] = "(no layers)"
    _check_complete(flat, targets, assigned, stacked)
    return LoadPlan(graphdef, flat, targets, groups, places)


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
