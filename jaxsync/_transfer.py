"""Explicit, alias-safe host->device uploads: one array, or many small ones in one transfer.

`jax.device_put` of a NumPy array is asynchronous and may read (or alias) the host buffer after
it returns (`tests/test_device_cache.py` shows it on CPU). Every
upload here first copies the caller's data into a fresh private host buffer that nobody mutates
afterwards, so a caller may reuse its staging arrays immediately. The copy costs one small host
allocation; it never waits on the device.

The private buffer then goes up through jaxlib's C++ transfer directly (`_put`, through
`jaxsync._compat`): with device work queued, most of a small upload's host time through
`jax.device_put` is its own Python, run cold, under both runtime clients; the C++ call under it
is a fraction of that.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import numbers
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync import _compat
from jaxsync._host import check_fits, refuse_masked, upload_dtype
from jaxsync._placement import Placement, resolve


_TARGETS: dict[Any, tuple[jax.sharding.Sharding, list[jax.Device]] | None] = {}


def _direct_target(target: jax.Device | jax.sharding.Sharding):
    """(sharding, devices) for the direct transfer, or None where only `device_put` will do
    (a sharding that splits the array). Memoised per target: shardings are hashable."""
    hit = _TARGETS.get(target, False)
    if hit is not False:
        return hit
    sharding = (
        jax.sharding.SingleDeviceSharding(target) if isinstance(target, jax.Device) else target
    )
    devices = _compat.direct_devices(sharding) if _compat.DIRECT_PUT else None
    hit = None if devices is None else (sharding, devices)
    _TARGETS[target] = hit
    return hit


def _put(host: np.ndarray, placement: Placement) -> jax.Array:
    """`jax.device_put(host, placement)` for a private host buffer nobody mutates afterwards.

    The same explicit transfer as `device_put` (the transfer guard counts it as explicit), made
    by jaxlib's C++ transfer without `device_put`'s Python around it (`jaxsync._compat`). Traced
    calls (the static scans of `jaxsync.check`), shardings that split the array and a jax
    without the private transfer take `jax.device_put`.
    """
    target = resolve(placement)
    if (
        isinstance(target, jax.sharding.Sharding)
        and not target.is_fully_addressable
        and not _compat.tracing()
    ):
        # A sharding over other processes' devices too: `device_put` would check on every
        # call that every process passed equal data (a gather read back to the host). Each
        # process places its own devices' blocks of its (equal, host) data instead.
        blocks = [
            jax.device_put(host[index], device)  # explicit: the transfer guard allows it
            for device, index in target.addressable_devices_indices_map(host.shape).items()
        ]
        return jax.make_array_from_single_device_arrays(host.shape, target, blocks)
    return _compat.direct_put(host, target, _direct_target(target))


def async_h2d(
    data: Any, *, dtype: Any = None, placement: Placement = None, copy: bool = True
) -> jax.Array:
    """Uploads a list or ndarray with one explicit transfer; never an implicit one.

    Args:
      data: host data (list, tuple, scalar or ndarray). A `jax.Array` is rejected: it is already
        on a device, and converting it would be a device->host read.
      dtype: optional target dtype (converted on the host).
      placement: device, sharding, or None for the default device.
      copy: False skips the private host copy where `data` is already a buffer the caller never
        touches again (e.g. a freshly padded batch): the transfer may read it after returning.

    Returns:
      A `jax.Array` whose value is independent of later mutation of `data` (with `copy=True`).

    Raises:
      TypeError: `data` is a `jax.Array` or a numpy masked array (its mask would be dropped).
      ValueError: a value does not fit in the device dtype (an int64 beyond int32 or a float64
        beyond float32's range with x64 off, or beyond `dtype`'s range): never wrapped or inf.

    >>> import numpy as np
    >>> ids = np.array([3, 1, 2], dtype=np.int32)
    >>> x = async_h2d(ids)
    >>> ids[:] = 0  # the caller may reuse its buffer at once
    >>> x.tolist()
    [3, 1, 2]
    """
    if isinstance(data, jax.Array):
        raise TypeError("async_h2d takes host data; got a jax.Array (already on a device)")
    refuse_masked(data, name="async_h2d data")
    src = np.asarray(data)
    check_fits(src, upload_dtype(src, dtype), name="async_h2d data")  # never wrapped, never inf
    host = np.array(src, dtype=dtype, copy=True) if copy else np.asarray(src, dtype=dtype)
    return _put(host, placement)  # a private buffer: see the module docstring


_WORD = np.dtype(np.uint32)
_PACKABLE = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32), np.dtype(np.bool_))


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # in 32-bit words
    size: int  # in 32-bit words


class _Layout:
    """One packed layout, interned: equal field tuples give the same object.

    It is a `Packed`'s pytree metadata, which jit hashes and compares on every call. Identity
    hashing and equality (object's C defaults) make that free; a tuple of dataclass fields
    costs Python-level hashing of every field per call (a no-op program taking a `Packed`
    dispatched measurably slower than one taking its raw buffer; interned, the two match).
    """

    __slots__ = ("fields", "__weakref__")
    _interned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    def __new__(cls, fields: tuple[_Field, ...]) -> _Layout:
        with cls._lock:
            layout = cls._interned.get(fields)
            if layout is None:
                layout = super().__new__(cls)
                layout.fields = fields
                cls._interned[fields] = layout
            return layout

    def __reduce__(self):  # pickling re-interns on load
        return (_Layout, (self.fields,))


class Packed:
    """Several small host arrays moved in one transfer, split on device.

    The layout (names, shapes, dtypes, offsets) is static pytree metadata, so a jitted function
    that takes a `Packed` is compiled once per layout and `packed["name"]` is a static slice there.
    Flattening runs in jax's C++ pytree code and the metadata compares by identity (`_Layout`).
    """

    def __init__(self, buffer: jax.Array, _layout: _Layout | tuple[_Field, ...]):
        self.buffer = buffer  # [W] uint32
        self._layout = _layout if isinstance(_layout, _Layout) else _Layout(tuple(_layout))

    @property
    def layout(self) -> tuple[_Field, ...]:
        """The fields: name, shape, dtype, offset and size (in 32-bit words) of each."""
        return self._layout.fields

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.layout)

    def __getitem__(self, name: str) -> jax.Array:
        for f in self.layout:
            if f.name == name:
                words = jax.lax.slice_in_dim(self.buffer, f.offset, f.offset + f.size)
                if f.dtype == np.bool_:
                    return (words != 0).reshape(f.shape)
                if f.dtype != _WORD:
                    words = jax.lax.bitcast_convert_type(words, jnp.dtype(f.dtype))
                return words.reshape(f.shape)
        raise KeyError(f"{name!r} is not in this upload; fields: {self.names}")

    def __getattr__(self, name: str) -> jax.Array:
        """`packed.name`: the field `name`, typed access for a plan's fields (a static slice
        inside jit); a name the upload lacks is an `AttributeError` at trace time."""
        if name.startswith("_") or name in ("buffer", "layout", "names"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(e.args[0]) from None

    def unpack(self) -> dict[str, jax.Array]:
        """All fields as a dict (call inside jit: each is a static slice)."""
        return {f.name: self[f.name] for f in self.layout}

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}{list(f.shape)}:{f.dtype}" for f in self.layout)
        return f"Packed({fields})"


# Flattened by jax's C++ pytree code (no Python call per jit dispatch).
jax.tree_util.register_dataclass(Packed, data_fields=["buffer"], meta_fields=["_layout"])


def upload_packed(fields: Mapping[str, Any] | Any, *, placement: Placement = None) -> Packed:
    """Packs host arrays (int32/uint32/float32/bool) into one buffer and uploads it once.

    `fields` is a mapping of names to arrays, or a family's plan (a NamedTuple whose `meta` is
    a NamedTuple of host arrays): the plan's `meta` goes up, read back in the forward as
    `meta.<name>`.

    int64 / uint64 fields are stored as int32 and float64 fields as float32; a value that does
    not fit is a `ValueError` (never wrapped or turned into inf); a masked array is a
    `TypeError` (its mask would be dropped).

    >>> import jax, numpy as np
    >>> p = upload_packed({"ids": np.array([4, 5], np.int32), "w": np.array([0.5], np.float32)})
    >>> @jax.jit
    ... def f(p):
    ...     return p["ids"] * 2, p["w"] + 1
    >>> [a.tolist() for a in f(p)]
    [[8, 10], [1.5]]
    """
    if hasattr(fields, "meta") and hasattr(fields.meta, "_asdict"):  # a family's plan
        fields = fields.meta._asdict()
    layout, chunks, offset = [], [], 0
    for name, value in fields.items():
        if isinstance(value, jax.Array):
            raise TypeError(f"field {name!r} is a jax.Array; upload_packed takes host data")
        refuse_masked(value, name=f"field {name!r}")
        arr = np.asarray(value)
        if arr.dtype == np.int64 or arr.dtype == np.uint64:
            check_fits(arr, np.int32, name=f"field {name!r}")
            arr = arr.astype(np.int32)
        elif arr.dtype == np.float64:
            check_fits(arr, np.float32, name=f"field {name!r}")
            arr = arr.astype(np.float32)
        if arr.dtype not in _PACKABLE:
            raise TypeError(
                f"field {name!r} has dtype {arr.dtype}; packable: int32, uint32, float32, bool"
            )
        words = (arr.astype(np.uint32) if arr.dtype == np.bool_ else arr).reshape(-1).view(_WORD)
        layout.append(_Field(name, tuple(arr.shape), arr.dtype, offset, words.size))
        chunks.append(words)
        offset += words.size
    # One fresh buffer per upload: never reused, so device_put's aliasing cannot leak mutations.
    host = np.concatenate(chunks) if chunks else np.zeros((0,), _WORD)
    return Packed(_put(host, placement), tuple(layout))  # layout interned by Packed


def _size(value: Any, what: str) -> int:
    """`value` as a Python int; bools, floats (nan and inf included) and other non-integers are a
    TypeError, never truncated."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


# Explicit bucket tuples already validated, by id (the entry holds the tuple, so its id is not
# reused) and by value (lists, and equal tuples built per call).
_CHECKED_IDS: dict[int, tuple[tuple, tuple[int, ...]]] = {}
_CHECKED: dict[tuple, tuple[int, ...]] = {}


def _checked_buckets(buckets: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """`buckets` as a validated tuple of increasing positive ints (validated once per value)."""
    by_id = _CHECKED_IDS.get(id(buckets))
    if by_id is not None and by_id[0] is buckets:
        return by_id[1]
    key = buckets if type(buckets) is tuple else tuple(buckets)
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit
    if not key:
        raise ValueError("buckets is empty: give at least one size, or None for powers of two")
    sizes = tuple(_size(b, "each bucket") for b in key)
    if sizes[0] <= 0:
        raise ValueError(f"buckets must be positive, got {list(key)}")
    if any(a >= b for a, b in itertools.pairwise(sizes)):
        raise ValueError(f"buckets must be strictly increasing, got {list(key)}")
    if len(_CHECKED) < 1024:  # a handful of distinct tuples in practice; never unbounded
        _CHECKED[key] = sizes
        if key is buckets:
            _CHECKED_IDS[id(key)] = (key, sizes)
    return sizes


def bucket(n: int, buckets: tuple[int, ...] | list[int] | None = None, *, minimum: int = 8) -> int:
    """The smallest bucket >= n, so that many sizes share one compiled program.

    Args:
      n: the real size (host metadata): an int >= 0 (a bool or float is a TypeError).
      buckets: explicit strictly increasing positive sizes; default: `minimum` times powers of
        two.
      minimum: smallest default bucket (a positive int).

    >>> bucket(5), bucket(9), bucket(0), bucket(70, [64, 128, 256])
    (8, 16, 8, 128)
    """
    if type(n) is not int:
        n = _size(n, "size")
    if n < 0:
        raise ValueError(f"size must be >= 0, got {n}")
    if buckets is not None:
        sizes = _checked_buckets(buckets)
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"size {n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]
    if type(minimum) is not int:
        minimum = _size(minimum, "minimum")
    if minimum <= 0:
        raise ValueError(f"minimum must be positive, got {minimum}")
    if n <= minimum:
        return minimum
    return minimum << (-(-n // minimum) - 1).bit_length()  # minimum * 2**k >= n, k smallest
