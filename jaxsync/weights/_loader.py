"""Strict, streaming loading of Hugging Face safetensors checkpoints into NNX modules.

The module is built abstractly (`nnx.eval_shape`, nothing allocated; `_abstract`). Then, from the
shard headers alone, every selected key is mapped through the rules and checked (stored shape
before any transform, dtype, placement), and every parameter is accounted for (`_plan`): all
strictness errors are raised before a byte of tensor data is read. Only then are the selected
tensors read, shard by shard, each transformed and placed on its device or sharding (`_stream`),
so host memory peaks at about one stacked parameter, not the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxsync.weights import _progress
from jaxsync.weights._abstract import abstract_module
from jaxsync.weights._placement import PartitionRules, ShardingFn
from jaxsync.weights._plan import path_str, plan_load
from jaxsync.weights._rules import Rule
from jaxsync.weights._sliced import LoadStats
from jaxsync.weights._stream import read_and_place


_last_stats: LoadStats | None = None


def last_load_stats() -> LoadStats | None:
    """What the last `load_weights` call of this process read (bytes, tensors, parameters read
    by blocks); None before the first load."""
    return _last_stats


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
    plan = plan_load(
        abstract_module(factory),
        checkpoint,
        rules,
        select=select,
        strip=strip,
        dtype=dtype,
        allow_cast=allow_cast,
        sharding=sharding,
        mesh=mesh,
        partition_rules=partition_rules,
    )
    total = sum(i.info.nbytes for g in plan.groups.values() for i in g)
    stats = LoadStats(selected_bytes=total)
    bar = _progress.Progress(total, progress)
    try:
        read_and_place(plan, stats, bar)
    finally:
        bar.close()
        global _last_stats
        _last_stats = stats
    return nnx.merge(plan.graphdef, nnx.from_flat_state(plan.flat))


def to_numpy_state(module: nnx.Module) -> dict[str, np.ndarray]:
    """Flat `{dotted path: array}` of a module's parameters (host copies; for tests and tools)."""
    _, state = nnx.split(module, nnx.Param)
    return {path_str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
