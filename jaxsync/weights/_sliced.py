"""Reading only the blocks of a parameter that this process's devices hold.

Under `jax.distributed` a parameter sharded over a mesh spanning several processes is built with
`jax.make_array_from_callback`: each process reads, for every distinct block its own devices
hold, just that block of the stored tensor (`safe_open(...).get_slice(key)[index]`), mapped back
through the rule's transform. A transform is mapped when it is a pure axis permutation (`linear`,
`conv(n)`, `transpose(...)`, a composition of them, a plain `lambda w: w.T`): found by applying
it to a small probe array of distinct axis sizes and values, and confirmed against the real
shapes. Any other transform (a reshape, arithmetic) cannot map an index; such a tensor is read
whole, once per process, and sliced after its transform.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


_PROBE_SIZES = (2, 3, 5, 7, 11, 13, 17)  # distinct, so an output axis names its input axis

Index = tuple[slice, ...]


@dataclasses.dataclass
class LoadStats:
    """What one `load_weights` call read, in this process.

    Attributes:
      bytes_read: bytes of tensor data read from the files (blocks, or whole tensors).
      selected_bytes: bytes of every selected tensor: what reading all of them whole takes.
      tensors: tensors (or blocks of tensors) read.
      sliced: parameters built from this process's blocks alone (their sharding spans other
        processes).
      whole: parameters spanning other processes whose transform cannot map a block index, so
        each process read their tensors whole.
    """

    bytes_read: int = 0
    selected_bytes: int = 0
    tensors: int = 0
    sliced: list[str] = dataclasses.field(default_factory=list)
    whole: list[str] = dataclasses.field(default_factory=list)


def splits_reading(place: Any) -> bool:
    """Whether a parameter's placement spans devices of other processes, so that this process
    reads only the blocks its own devices hold."""
    return isinstance(place, jax.sharding.Sharding) and not place.is_fully_addressable


def permutation(transform: Callable | None, stored: tuple[int, ...], param: tuple[int, ...]):
    """`perm` with `param = stored.transpose(perm)` when `transform` is a pure axis permutation
    (parameter axis i is stored axis perm[i]); None when it is not, or not recognisably."""
    ndim = len(stored)
    if transform is None:
        return tuple(range(ndim)) if stored == param else None
    if ndim > len(_PROBE_SIZES) or len(param) != ndim:
        return None
    sizes = _PROBE_SIZES[:ndim]
    # Distinct signed values: arithmetic on them (a scale, a shift, a min subtracted) shows.
    values = np.random.default_rng(0).permutation(math.prod(sizes)) - math.prod(sizes) // 2
    probe = values.astype(np.float32).reshape(sizes)
    try:
        out = np.asarray(transform(probe))
    except Exception:  # a transform that cannot run on the probe (a fixed reshape) is not mapped
        return None
    if out.ndim != ndim or sorted(out.shape) != sorted(sizes):
        return None
    perm = tuple(sizes.index(n) for n in out.shape)
    if not np.array_equal(out, probe.transpose(perm)):
        return None
    if tuple(stored[a] for a in perm) != tuple(param):  # the real shapes must agree too
        return None
    return perm


def stored_index(index: Index, perm: tuple[int, ...]) -> Index:
    """A parameter block's index as an index of the stored tensor."""
    out: list[slice] = [slice(None)] * len(perm)
    for axis, part in enumerate(index):
        out[perm[axis]] = part
    return tuple(out)


def full_index(index: Index, ndim: int) -> Index:
    """`index` with a whole-axis slice for each axis it leaves out."""
    return tuple(index) + (slice(None),) * (ndim - len(index))


def index_key(index: Index, shape: tuple[int, ...]) -> tuple:
    """A hashable, normalised form of a block index (devices holding one block share it)."""
    index = full_index(index, len(shape))
    return tuple(part.indices(n) for part, n in zip(index, shape, strict=True))


class BlockReader:
    """Reads one parameter's blocks: `block(index)` for a parameter loaded from one tensor,
    per layer for a stacked one, per row for one grouping tensors along its first axis.

    Args:
      items: the parameter's `_Load`s (one with `.index` `()`, or one per layer or row with
        `.index` `(layer,)`, `(row,)` or `(layer, row)`).
      shape: the parameter's shape (`[L, ...]` when stacked).
      read_block: `(item, stored_index or None) -> host array` reading one block (None: the whole
        tensor), transformed and cast, and counting its bytes.
    """

    def __init__(self, items: list, shape: tuple[int, ...], read_block: Callable):
        self.shape = shape
        self.read_block = read_block
        self.layers = {item.index: item for item in items}
        self.depth = len(items[0].index)  # leading axes indexed per tensor
        layer_shape = shape[self.depth :]
        self.perms = {
            item.index: permutation(item.transform, item.info.shape, layer_shape) for item in items
        }
        self.whole: dict[Any, np.ndarray] = {}  # tensors read whole, kept for their other blocks

    @property
    def mapped(self) -> bool:
        """Whether every tensor's transform maps a block index (else some are read whole)."""
        return all(p is not None for p in self.perms.values())

    def block(self, index: Index) -> np.ndarray:
        index = full_index(index, len(self.shape))
        k = self.depth
        if not k:
            return self._tensor_block((), index)
        ranges = [range(self.shape[a])[index[a]] for a in range(k)]
        parts = [self._tensor_block(lead, index[k:]) for lead in itertools.product(*ranges)]
        if not parts:
            return np.empty((*map(len, ranges), *self.shape[k:]))
        return np.stack(parts).reshape(*map(len, ranges), *parts[0].shape)

    def _tensor_block(self, lead: tuple[int, ...], index: Index) -> np.ndarray:
        item, perm = self.layers[lead], self.perms[lead]
        if perm is not None:
            return self.read_block(item, stored_index(index, perm))
        if lead not in self.whole:
            self.whole[lead] = self.read_block(item, None)
        return self.whole[lead][index]


def sharded_array(reader: BlockReader, sharding: jax.sharding.Sharding, dtype: Any) -> jax.Array:
    """The parameter as a global array over `sharding`, built from this process's blocks: each
    distinct block its devices hold is read once, whatever the number of devices holding it."""
    shape = reader.shape
    blocks: dict[tuple, np.ndarray] = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        key = index_key(index, shape)
        if key not in blocks:
            blocks[key] = np.asarray(reader.block(index), dtype)
    reader.whole.clear()  # the whole tensors are no longer needed; the blocks are
    return jax.make_array_from_callback(shape, sharding, lambda i: blocks[index_key(i, shape)])
