"""Layer files of a saved request: the dtypes a safetensors file can hold, layer names that can
be file names, a folder that can be written, and one stored tensor read back (float8 included).
"""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, deserialize, safe_open

from jaxsync.kv._layout import Cache, StackedCache


# Cache dtypes a layer file can hold: safetensors' dtype set, by numpy name.
_STORABLE = frozenset(
    ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
     "bfloat16", "float32", "float64", "complex64", "float8_e4m3fn", "float8_e4m3fnuz",
     "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"]
)  # fmt: skip

# Stored dtypes safetensors' numpy reader cannot return (it looks their names up on numpy, which
# has no float8 types): their bytes are read as the ml_dtypes type instead.
_RAW = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


def check_storable(caches: Cache) -> None:
    """Every leaf's dtype is one a safetensors file can hold (checked before any gather, so an
    unsupported cache never leaves a half-written folder behind)."""
    for dtype in {np.dtype(x.dtype) for x in jax.tree.leaves(caches)}:
        if dtype.name not in _STORABLE:
            raise TypeError(f"a KV file cannot hold {dtype.name}; supported: {sorted(_STORABLE)}")


def check_layer_names(caches: Cache) -> None:
    for name in caches.layers if isinstance(caches, StackedCache) else caches:
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {type(name).__name__} {name!r}")
        if not name or "/" in name or os.sep in name or "\0" in name or name in (".", ".."):
            raise ValueError(f"layer name {name!r} cannot be a file name")


def writable_folder(folder: str) -> None:
    """Creates `folder` (an OSError such as NotADirectoryError if its parent is a file) and
    checks it is writable, before anything is gathered or read back."""
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write KV files into {folder}")


def read_tensor(path: str, name: str) -> np.ndarray:
    """One stored tensor; a file that is not valid safetensors (truncated, corrupt) or lacks
    the tensor is a ValueError naming it."""
    try:
        with safe_open(path, framework="numpy") as f:
            stored = f.get_slice(name).get_dtype()
            if stored not in _RAW:
                return f.get_tensor(name)
        with open(path, "rb") as f:
            tensor = dict(deserialize(f.read()))[name]
        return np.frombuffer(tensor["data"], _RAW[stored]).reshape(tensor["shape"])
    except (SafetensorError, OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path} is not a readable safetensors file with {name!r}: {e}") from e
