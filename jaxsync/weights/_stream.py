"""Reading a checked load's tensors, transforming them on the host and placing them.

Tensors are read shard by shard straight from the file offsets their headers give; transforms and
casts run in numpy on the host (no device program per tensor). A parameter from one tensor is
placed as soon as it is read; a stacked parameter is assembled on the host from its L slices and
placed once, so host memory peaks at about one stacked parameter. A parameter whose sharding spans
devices of other processes is built from the blocks this process's devices hold (`_sliced`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxsync.weights._checkpoint import host_buffer, open_shard, read_slice, read_tensor
from jaxsync.weights._plan import LoadPlan, TensorLoad
from jaxsync.weights._progress import Progress
from jaxsync.weights._sliced import BlockReader, LoadStats, sharded_array, splits_reading


def read_and_place(plan: LoadPlan, stats: LoadStats, bar: Progress) -> None:
    """Fills every parameter of `plan.flat` from its tensors, counting into `stats` and `bar`."""
    flat, targets = plan.flat, plan.targets
    with contextlib.ExitStack() as files:
        handles: dict[Path, Any] = {}

        def handle(item: TensorLoad) -> Any:
            if item.info.file not in handles:
                handles[item.info.file] = files.enter_context(open_shard(item.info.file))
            return handles[item.info.file]

        def read_block(
            item: TensorLoad, index: tuple[slice, ...] | None, out: np.ndarray | None = None
        ) -> np.ndarray:
            """One tensor (index None) or one block of it, transformed and cast; a tensor kept
            as stored is read straight into `out` when one is given."""
            if index is None:
                kept = item.transform is None and item.cast is None
                raw = read_tensor(handle(item), item.info, out=out if kept else None)
            else:
                raw = read_slice(handle(item), item.info, index)
            stats.bytes_read += raw.nbytes
            stats.tensors += 1
            return _host_value(item, raw)

        def read(item: TensorLoad, out: np.ndarray | None = None) -> np.ndarray:
            value = read_block(item, None, out)
            bar.update(item.info.nbytes)
            return value

        for target, items in plan.groups.items():
            variable = flat[targets[target]]
            place = plan.places[target]
            if splits_reading(place):  # this process reads only its own blocks
                expected = variable.get_value()
                reader = BlockReader(items, tuple(expected.shape), read_block)
                (stats.sliced if reader.mapped else stats.whole).append(target)
                variable.set_value(sharded_array(reader, place, expected.dtype))
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
            variable.set_value(jax.device_put(host, place))
            del host


def _host_value(item: TensorLoad, value: Any) -> np.ndarray:
    """One tensor transformed and cast in numpy on the host (no device program per tensor)."""
    value = np.asarray(value)
    if item.transform is not None:
        value = np.asarray(item.transform(value))
    if item.cast is not None:
        value = value.astype(item.cast)
    return value
