"""Reading a checked load's tensors, transforming them on the host and placing them.

Tensors are read shard by shard straight from the file offsets their headers give, with no
device program per tensor. Each parameter gets one host buffer, page-aligned from 1 MiB
(`[L, ...]` for a stacked one, placed once: host memory peaks at about one stacked parameter
above the placed ones). A tensor kept as stored is read straight into its place in it; any
other is read into one reused scratch buffer and written into its place once, through its
transform's numpy views and cast in the same pass (`_views`). On a device that is the host, the
buffer is placed without a copy. A parameter whose sharding spans devices of other processes is
built from the blocks this process's devices hold (`_sliced`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxsync.weights._checkpoint import (
    TensorInfo,
    host_buffer,
    open_shard,
    read_slice,
    read_tensor,
)
from jaxsync.weights._plan import LoadPlan, TensorLoad
from jaxsync.weights._progress import Progress
from jaxsync.weights._sliced import BlockReader, LoadStats, sharded_array, splits_reading
from jaxsync.weights._views import view_chain, write


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

        scratch = _Scratch(plan)

        def fill(slot: np.ndarray, item: TensorLoad) -> None:
            """`slot[...] =` the tensor, transformed and cast: read straight into the slot when
            kept as stored, else into the scratch buffer and written once through the
            transform's views (`_views`)."""
            info = item.info
            ops = view_chain(item.transform, info.shape, info.dtype)
            if ops is None or (item.cast is not None and slot.dtype != item.cast):
                slot[...] = read(item)  # any other transform, or a cast then another cast
                return
            kept = not ops and item.cast is None and slot.dtype == info.dtype
            raw = read_tensor(handle(item), info, out=slot if kept else scratch.get(info))
            stats.bytes_read += raw.nbytes
            stats.tensors += 1
            if not kept:
                write(slot, raw, ops)  # one copy through the transform's views
            bar.update(info.nbytes)

        for target, items in plan.groups.items():
            variable = flat[targets[target]]
            place = plan.places[target]
            expected = variable.get_value()
            if splits_reading(place):  # this process reads only its own blocks
                reader = BlockReader(items, tuple(expected.shape), read_block)
                (stats.sliced if reader.mapped else stats.whole).append(target)
                variable.set_value(sharded_array(reader, place, expected.dtype))
                for item in items:  # the bar follows the checkpoint, not the bytes read
                    bar.update(item.info.nbytes)
                continue
            if not items[0].index:  # one tensor, into a buffer of its transformed dtype
                item = items[0]
                if view_chain(item.transform, item.info.shape, item.info.dtype) is None:
                    host = read(item)
                else:
                    host = host_buffer(expected.shape, item.cast or item.info.dtype)
                    fill(host, item)
            else:  # one host buffer for the L slices (or rows), placed once
                host = host_buffer(expected.shape, expected.dtype)
                for item in sorted(items, key=lambda i: (str(i.info.file), i.index)):
                    fill(host[item.index], item)
            # A page-aligned host buffer is placed without a copy where the device is the host.
            variable.set_value(jax.device_put(host, place))
            del host


class _Scratch:
    """One reused host buffer that tensors needing a transform or cast are read into, sized
    for the largest of them (allocated on first use: a load of kept tensors needs none)."""

    def __init__(self, plan: LoadPlan):
        items = [i for g in plan.groups.values() for i in g]
        changed = [i for i in items if i.transform is not None or i.cast is not None]
        self.nbytes = max((i.info.nbytes for i in changed), default=0)
        self.buffer: np.ndarray | None = None

    def get(self, info: TensorInfo) -> np.ndarray:
        if self.buffer is None or self.buffer.nbytes < info.nbytes:
            self.buffer = host_buffer((max(self.nbytes, info.nbytes),), np.uint8)
        return self.buffer[: info.nbytes].view(info.dtype).reshape(info.shape)


def _host_value(item: TensorLoad, value: Any) -> np.ndarray:
    """One tensor transformed and cast in numpy on the host (no device program per tensor)."""
    value = np.asarray(value)
    if item.transform is not None:
        value = np.asarray(item.transform(value))
    if item.cast is not None:
        value = value.astype(item.cast)
    return value
