"""Strict loading of Hugging Face safetensors checkpoints into NNX modules.

The module is built abstractly (`nnx.eval_shape`, nothing allocated), every checkpoint tensor is
read on the host CPU device, mapped through the rules, checked, and placed once; then the module is
merged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxsync.weights._rules import Rule


class WeightError(ValueError):
    """A checkpoint does not fit the module; the message names the key or parameter."""


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, a `*.index.json`, or a directory of either."""
    path = Path(checkpoint)
    if path.is_dir():
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            path = index[0]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise WeightError(f"no *.safetensors files in {path}")
            return files
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        return [path.parent / f for f in sorted(set(weight_map.values()))]
    if not path.exists():
        raise WeightError(f"checkpoint {path} does not exist")
    return [path]


def read_checkpoint(checkpoint: str | Path) -> Iterator[tuple[str, jax.Array]]:
    """Yields (key, tensor) for every tensor, read onto the host CPU device (bf16 kept as bf16)."""
    cpu = jax.devices("cpu")[0]
    for file in checkpoint_files(checkpoint):
        with jax.default_device(cpu), safe_open(str(file), framework="flax") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def load_weights(
    factory: Callable[[], nnx.Module],
    checkpoint: str | Path,
    rules: Sequence[Rule],
    *,
    select: str | None = None,
    strip: str = "",
    allow_cast: bool = False,
    sharding: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] | None = None,
) -> nnx.Module:
    """Builds `factory()` abstractly and fills every parameter from `checkpoint`.

    Args:
      factory: zero-argument callable building the module (run under `nnx.eval_shape`).
      checkpoint: a `.safetensors` file, a sharded `*.index.json`, or a directory.
      rules: the key mapping; the first rule that matches a key wins.
      select: regex; only keys with `re.match(select, key)` are loaded, the rest belong to other
        modules and are ignored. None selects every key.
      strip: prefix removed from selected keys before matching rules.
      allow_cast: allow float->float dtype conversion (e.g. an fp32 checkpoint into a bf16 module).
      sharding: optional `(param_path, shape) -> Sharding | None` placement per parameter.

    Returns:
      The module with every parameter loaded.

    Raises:
      WeightError: a selected key no rule matches, a target that is not a parameter of the module,
        a key mapped twice, a parameter left unassigned, a shape mismatch, or a dtype mismatch.
    """
    abstract = nnx.eval_shape(factory)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    targets = {_path_str(p): p for p in flat}
    assigned: dict[str, str] = {}
    default = jax.config.jax_default_device or jax.devices()[0]

    for key, tensor in read_checkpoint(checkpoint):
        if select is not None and not re.match(select, key):
            continue
        if strip and not key.startswith(strip):
            raise WeightError(f"checkpoint key {key!r} does not start with {strip!r}")
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
        value = rule.transform(tensor) if rule.transform else tensor
        if tuple(value.shape) != tuple(expected.shape):
            raise WeightError(
                f"checkpoint key {key!r} -> {target!r}: shape {tuple(value.shape)} "
                f"(after transform) but the module expects {tuple(expected.shape)}"
            )
        if value.dtype != expected.dtype:
            floats = jnp.issubdtype(value.dtype, jnp.floating) and jnp.issubdtype(
                expected.dtype, jnp.floating
            )
            if not (allow_cast and floats):
                raise WeightError(
                    f"checkpoint key {key!r} -> {target!r}: dtype {value.dtype} but the module "
                    f"expects {expected.dtype} (pass allow_cast=True for float conversions)"
                )
            value = value.astype(expected.dtype)
        place = (sharding(target, tuple(value.shape)) if sharding else None) or default
        variable.set_value(jax.device_put(value, place))
        assigned[target] = key

    missing = [t for t in targets if t not in assigned and _is_param(flat[targets[t]])]
    if missing:
        raise WeightError(f"{len(missing)} parameter(s) not in the checkpoint: {missing[:8]}")
    leftover = [t for t in targets if t not in assigned]
    for t in leftover:  # non-parameter state (e.g. buffers computed in __init__) is materialised
        v = flat[targets[t]]
        if isinstance(v.get_value(), jax.ShapeDtypeStruct):
            raise WeightError(
                f"state {t!r} is not a parameter and not in the checkpoint; derive such constants "
                "from the config (numpy / DeviceCache) instead of storing them as nnx state"
            )
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _is_param(variable: Any) -> bool:
    return isinstance(variable, nnx.Param)


def to_numpy_state(module: nnx.Module) -> dict[str, np.ndarray]:
    """Flat `{dotted path: array}` of a module's parameters (host copies; for tests and tools)."""
    _, state = nnx.split(module, nnx.Param)
    return {_path_str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
