"""Host-side checks of block and slot ids, run by every kv entry point before dispatch: ints
only (never truncated), 1-D, in range, unique where they are scatter targets; and their padding
to a bucket."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxsync._host import host_array, is_torch_tensor


def host_ids(ids: Any, name: str) -> np.ndarray:
    """Block or slot ids as a 1-D int64 host array.

    Lists, tuples, ranges, numpy arrays and torch CPU tensors are host data. Raises TypeError on
    device arrays (a readback: jax arrays, torch tensors on a GPU), strings, and elements that are
    not integers (floats, bools: never truncated); ValueError on nested or ragged lists and ids
    beyond int64. Numpy integer scalars of any mix of types are taken at their values."""
    if isinstance(ids, jax.Array):
        raise TypeError(f"{name} must be host data (list/ndarray); a jax.Array would be read back")
    if not isinstance(ids, np.ndarray | list | tuple | range) and is_torch_tensor(ids):
        # upstream's block tables: a CPU tensor is host data, one on a GPU is refused
        ids = host_array(ids, name=name)
    if isinstance(ids, np.ndarray):
        arr = ids
    elif isinstance(ids, list | tuple | range):
        arr = None
        # One C-level pass (bools would pass numpy's conversion as ints), then a conversion
        # that needs no type inference; ints beyond int64 take the checked path below.
        if list(map(type, ids)).count(int) == len(ids):
            try:
                arr = np.fromiter(ids, np.int64, len(ids))
            except OverflowError:
                pass
        else:
            _check_element_types(set(map(type, ids)), name)
        if arr is None or (arr.size and arr.dtype.kind not in "iu"):
            # Python ints beyond int64 (object or float64 arrays), or numpy's promotion of mixed
            # integer scalars (uint64 with int64 gives float64): checked as Python ints.
            values = [int(x) for x in ids]
            info = np.iinfo(np.int64)
            if values and (min(values) < info.min or max(values) > info.max):
                raise ValueError(f"{name} must lie in the int64 range; got {values[:8]}")
            arr = np.array(values, np.int64)
    else:
        raise TypeError(f"{name} must be a list or 1-D ndarray of ints, got {type(ids).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros((0,), np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold ints, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:  # would wrap negative
        big = arr[arr > np.iinfo(np.int64).max]
        raise ValueError(f"{name} must lie in the int64 range; got {big[:8].tolist()}")
    return arr.astype(np.int64)


def _check_element_types(types: set, name: str) -> None:
    for t in types:
        if issubclass(t, list | tuple | np.ndarray):
            raise ValueError(f"{name} must be a 1-D list of ints, got nested (or ragged) sequences")
    for t in types:
        if issubclass(t, bool | np.bool_) or not issubclass(t, int | np.integer):
            raise TypeError(f"{name} must hold ints, got {t.__name__}")


def host_int(value: Any, name: str) -> int:
    """A Python or numpy integer as int; TypeError on bools, floats and anything else."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


PAD = -1
"""vLLM's padding slot (`slot_mapping` entries of padded tokens): writes nothing, reads zeros."""


def check_range(ids: np.ndarray, limit: int, name: str, *, padding: bool = False) -> None:
    """0 <= ids < limit, or ids == PAD where `padding` allows it. Any other negative id is
    refused: jnp indexing would wrap it silently onto a real block."""
    low = PAD if padding else 0
    if ids.size and (ids.min() < low or ids.max() >= limit):
        bad = ids[(ids < low) | (ids >= limit)]
        allowed = f"[0, {limit}) or be {PAD} (padding)" if padding else f"[0, {limit})"
        raise ValueError(f"{name} must lie in {allowed}; got {bad[:8].tolist()}")


def check_unique(ids: np.ndarray, name: str) -> None:
    """Duplicate scatter targets would make the result depend on XLA's write order. Padding
    (PAD) writes nothing and may repeat."""
    ordered = np.sort(ids[ids != PAD])
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        raise ValueError(f"{name} must be unique; repeated: {np.unique(repeated)[:8].tolist()}")


def padded_ids(ids: np.ndarray, fill: Any) -> np.ndarray:
    """`fill` (the bucket's length of padding ids) as int32, its head replaced by `ids`."""
    out = np.array(fill, np.int32)
    out[: ids.size] = ids
    return out


def checked_ids(src_ids: Any, dst_ids: Any, num_src: int, num_dst: int) -> tuple[np.ndarray, ...]:
    """Block-id pairs of a copy, validated on the host: same length, in range, dst unique."""
    s, d = host_ids(src_ids, "src_ids"), host_ids(dst_ids, "dst_ids")
    if s.size != d.size:
        # Upstream silently does nothing here; a caller with such lists has a bug.
        raise ValueError(f"src_ids has {s.size} ids but dst_ids has {d.size}")
    check_range(s, num_src, "src_ids")
    check_range(d, num_dst, "dst_ids")
    check_unique(d, "dst_ids")
    return s, d
