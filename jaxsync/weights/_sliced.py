"""Reading only the blocks of a parameter that this process's devices hold.

Under `jax.distributed` a parameter sharded over a mesh spanning several processes is built with
`jax.make_array_from_callback`: each process reads, for every distinct block its own devices
hold, just the part of the stored tensor that block takes (`safe_open(...).get_slice(key)[...]`),
mapped back through the rule's transform:

* a transform marked `axes_only` (`linear`, `conv(n)`, `transpose(...)`, compositions of them)
  permutes axes whatever the shape: the block's index, permuted, is the stored block (the
  permutation found by applying it to a small probe array of distinct axis sizes and values);
* any other transform (a plain callable, a reshape-transpose-reshape reordering one axis in
  groups) is run on the stored tensor's element indices at the real shape (`gather_map`); when
  it only moves elements, separably per axis, the block takes given rows of each stored axis,
  read as contiguous runs and gathered (GLM-4.1V's head-major qkv, gemma3n's GLU pairs);
* a transform that changes values, mixes axes (a reshape to another rank), or whose tensor is
  over `_GATHER_LIMIT` elements maps no index: that tensor is read whole, once per process, and
  sliced after its transform.
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


_GATHER_LIMIT = 1 << 24  # elements: a larger tensor's transform is not probed (the probe's memory)
_MAX_READS = 64  # contiguous reads for one block; past it, the bounding box of its rows is read


@dataclasses.dataclass(frozen=True)
class Gather:
    """A transform that only moves elements, separably per axis: `param =
    stored.transpose(perm)[np.ix_(*rows)]` (parameter axis i is stored axis perm[i], taken at
    positions rows[i]). A reshape-transpose-reshape that reorders one axis in groups (GLM-4.1V's
    head-major qkv, gemma3n's GLU pairs) is one."""

    perm: tuple[int, ...]
    rows: tuple[np.ndarray, ...]

    def read(self, read_raw: Callable[[Index], np.ndarray], index: Index) -> np.ndarray:
        """A parameter block from the stored rows it takes: each stored axis' needed positions
        read as contiguous runs (`read_raw(stored index)`), then gathered and transposed."""
        picks: list[np.ndarray] = [np.empty(0, np.int64)] * len(self.perm)
        for axis, part in enumerate(index):
            picks[self.perm[axis]] = self.rows[axis][part]
        if any(p.size == 0 for p in picks):
            return np.empty(tuple(len(r[i]) for r, i in zip(self.rows, index, strict=True)))
        wanted = [np.unique(p) for p in picks]
        runs = [_runs(u) for u in wanted]
        if math.prod(len(r) for r in runs) > _MAX_READS:
            wanted = [np.arange(u[0], u[-1] + 1) for u in wanted]
            runs = [[(0, int(u[0]), int(u[-1]) + 1)] for u in wanted]
        buf = None
        for combo in itertools.product(*runs):
            part = read_raw(tuple(slice(a, b) for _, a, b in combo))
            if buf is None:
                buf = np.empty(tuple(len(u) for u in wanted), part.dtype)
            buf[tuple(slice(o, o + b - a) for o, a, b in combo)] = part
        pos = [np.searchsorted(u, p) for u, p in zip(wanted, picks, strict=True)]
        return buf.transpose(self.perm)[np.ix_(*(pos[a] for a in self.perm))]


def _runs(sorted_unique: np.ndarray) -> list[tuple[int, int, int]]:
    """`(offset in the array, start, stop)` of each run of consecutive values."""
    breaks = np.flatnonzero(np.diff(sorted_unique) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [sorted_unique.size]])
    return [
        (int(a), int(sorted_unique[a]), int(sorted_unique[b - 1]) + 1)
        for a, b in zip(starts, stops, strict=True)
    ]


def gather_map(transform: Callable | None, stored: tuple[int, ...], param: tuple[int, ...]):
    """The `Gather` a transform is on a tensor of shape `stored`, or None.

    The transform runs on the stored tensor's element indices (int64, offset by the element
    count, of the real shape: a reshape to fixed sizes runs as on the weight): a result of the
    parameter's shape and dtype whose every element is a stored index, whose indices split into
    one stored axis per parameter axis, and which takes the negated indices to the negated
    result, is a gather. Arithmetic moves the values off their indices, off int64, or breaks the
    sign symmetry (abs, clip), so it is not taken for one. Tensors over `_GATHER_LIMIT` elements
    are not probed.
    """
    ndim = len(stored)
    numel = math.prod(stored)
    if transform is None or ndim == 0 or len(param) != ndim or not 0 < numel <= _GATHER_LIMIT:
        return None
    probe = np.arange(numel, 2 * numel, dtype=np.int64).reshape(stored)
    try:
        out = np.asarray(transform(probe))
        negated = np.asarray(transform(-probe))
    except Exception:  # a transform that cannot run on the indices is not mapped
        return None
    del probe
    if out.shape != tuple(param) or out.dtype != np.int64 or not np.array_equal(negated, -out):
        return None
    del negated
    out = out - numel
    if out.min() < 0 or out.max() >= numel:
        return None
    strides = [math.prod(stored[a + 1 :]) for a in range(ndim)]
    perm: list[int | None] = [None] * ndim
    rows: list[np.ndarray] = []
    for i in range(ndim):
        line = out[tuple(slice(None) if a == i else 0 for a in range(ndim))]
        coords = np.unravel_index(line, stored)
        moving = [a for a in range(ndim) if np.any(coords[a] != coords[a][0])]
        if len(moving) > 1:
            return None
        perm[i] = moving[0] if moving else None
        rows.append(coords[moving[0]] if moving else coords[0][:1])
    free = [a for a in range(ndim) if a not in perm]
    for i in range(ndim):
        if perm[i] is None:  # an axis of size 1: whichever stored axis is left, at its position
            perm[i] = free.pop(0)
            rows[i] = np.atleast_1d(np.unravel_index(out.flat[0], stored)[perm[i]])
    if sorted(perm) != list(range(ndim)):
        return None
    flat = np.zeros((1,) * ndim, np.int64)
    for i, (a, r) in enumerate(zip(perm, rows, strict=True)):
        flat = flat + (strides[a] * r.astype(np.int64)).reshape(
            [-1 if b == i else 1 for b in range(ndim)]
        )
    if not np.array_equal(out, flat):
        return None
    return Gather(tuple(perm), tuple(np.asarray(r, np.int64) for r in rows))


class BlockReader:
    """Reads one parameter's blocks: `block(index)` for a parameter loaded from one tensor,
    per layer for a stacked one, per row for one grouping tensors along its first axis.

    Args:
      items: the parameter's `TensorLoad`s (one with `.index` `()`, or one per layer or row with
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
        self.perms = {  # transforms permuting axes whatever the shape (None: no transform)
            item.index: permutation(item.transform, item.info.shape, layer_shape)
            if item.transform is None or getattr(item.transform, "axes_only", False)
            else None
            for item in items
        }
        self.gathers = {}  # any other transform: a gather, probed at the real shape (`Gather`)
        for lead, item in self.layers.items():
            if self.perms[lead] is None:
                self.gathers[lead] = _gather_of(item.transform, item.info.shape, layer_shape)
        self.whole: dict[Any, np.ndarray] = {}  # tensors read whole, kept for their other blocks

    @property
    def mapped(self) -> bool:
        """Whether every tensor's transform maps a block index (else some are read whole)."""
        return all(p is not None or self.gathers[k] is not None for k, p in self.perms.items())

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
        if (gather := self.gathers[lead]) is not None:  # the stored rows it takes, untransformed
            raw = dataclasses.replace(item, transform=None)
            return gather.read(lambda stored: self.read_block(raw, stored), index)
        if lead not in self.whole:
            self.whole[lead] = self.read_block(item, None)
        return self.whole[lead][index]


_GATHERS: dict[Any, Gather | None] = {}  # (transform, stored, param) -> its gather, per load


def _gather_of(transform: Callable | None, stored: tuple, param: tuple) -> Gather | None:
    """`gather_map`, once per transform and shapes (a stacked parameter's layers share one)."""
    try:
        key = (transform, tuple(stored), tuple(param))
        hash(key)
    except TypeError:
        return gather_map(transform, stored, param)
    if key not in _GATHERS:
        if len(_GATHERS) >= 16:
            _GATHERS.pop(next(iter(_GATHERS)))
        _GATHERS[key] = gather_map(transform, stored, param)
    return _GATHERS[key]


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
