"""Lazy access to safetensors checkpoints: headers first, then only the tensors a module needs.

A sharded checkpoint's `*.index.json` says which shard holds each key, so shards holding none of
the selected keys are never opened. Every failure of the files themselves (missing, truncated,
garbage header, an index naming a key its shard lacks) is a `WeightError` naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open


class WeightError(ValueError):
    """A checkpoint does not fit the module, or is unreadable; the message names the key or file."""


HUB_HINT = (
    "Hub ids are not downloaded: pass a local folder (e.g. the one "
    "huggingface_hub.snapshot_download(repo_id) returns)"
)
"""Said by every error about a checkpoint path that does not exist."""


_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor as its shard's header describes it (nothing read yet)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: jnp.dtype
    offset: int | None = None  # where its bytes start in the file (None: read through safetensors)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, a `*.index.json`, or a directory of either."""
    index, files = _resolve(checkpoint)
    return files if index is None else sorted(set(index.values()))


def checkpoint_keys(checkpoint: str | Path) -> list[str]:
    """Every tensor name of a checkpoint: from the index alone when there is one (no shard
    opened), else from each file's header."""
    index, files = _resolve(checkpoint)
    if index is not None:
        return sorted(index)
    keys: list[str] = []
    for file in files:
        with open_shard(file) as handle:
            keys.extend(handle.keys())
    return keys


def _resolve(checkpoint: str | Path) -> tuple[dict[str, Path] | None, list[Path]]:
    """(key -> shard file from the index, or None; the files when there is no index)."""
    given = str(checkpoint)
    path = Path(checkpoint)
    if path.is_dir():
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            path = index[0]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise WeightError(
                    f"no *.safetensors files in checkpoint folder {given!r} (nor a "
                    "*.safetensors.index.json)"
                )
            return None, files
    if not path.exists():
        raise WeightError(f"checkpoint {given!r} does not exist. {HUB_HINT}")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            return {str(k): path.parent / str(f) for k, f in weight_map.items()}, []
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightError(f"unreadable checkpoint index {path}: {e!r}") from None
    return None, [path]


@contextlib.contextmanager
def open_shard(file: Path) -> Iterator[Any]:
    """`safe_open`s one shard; tensors read from it land on the host CPU device (bf16 kept)."""
    with contextlib.ExitStack() as stack:
        # This process's own CPU device: under `jax.distributed` the first global one may be
        # another process's, where no array of this process can live.
        stack.enter_context(jax.default_device(jax.local_devices(backend="cpu")[0]))
        try:
            handle = stack.enter_context(safe_open(str(file), framework="flax"))
        except (SafetensorError, OSError) as e:
            raise WeightError(f"unreadable safetensors file {file}: {e}") from e
        yield handle


_POPULATE_BYTES = 1 << 20


def host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised host array; one of 1 MiB or more is mapped with its pages populated by
    the kernel in one call (`MAP_POPULATE`), not faulted in page by page as it is first written
    (several times faster where page faults are dear, as in virtual machines)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    flags = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < _POPULATE_BYTES or not flags:
        return np.empty(shape, dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return np.frombuffer(memory, dtype).reshape(shape)


def read_tensor(handle: Any, info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    """Reads one tensor's bytes from an open shard into a host numpy array (bf16 kept as bf16;
    the only reader): straight from the file at the offset its header gives, one copy, into
    `out` when given (a C-contiguous array of the tensor's shape and dtype, returned)."""
    if info.offset is None:
        try:
            value = np.asarray(handle.get_tensor(info.key))
        except (SafetensorError, OSError) as e:
            raise WeightError(f"cannot read {info.key!r} from {info.file}: {e}") from e
        if out is None:
            return value
        out[...] = value
        return out
    if out is None or out.shape != info.shape or out.dtype != info.dtype:
        out = host_buffer(info.shape, info.dtype)
    elif not out.flags.c_contiguous:
        raise ValueError("read_tensor needs a C-contiguous out array")
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    try:
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.offset)
            while done < info.nbytes and (n := f.readinto(view[done:])):
                done += n
    except OSError as e:
        raise WeightError(f"cannot read {info.key!r} from {info.file}: {e}") from e
    if done != info.nbytes:
        raise WeightError(
            f"cannot read {info.key!r} from {info.file}: the file ends {info.nbytes - done} "
            "bytes early"
        )
    return out


def read_slice(handle: Any, info: TensorInfo, index: tuple[slice, ...]) -> np.ndarray:
    """Reads one block of a stored tensor (`index`: a slice per stored axis) onto the host; only
    the block's bytes are read from the file."""
    try:
        return np.asarray(handle.get_slice(info.key)[index])
    except (SafetensorError, OSError) as e:
        raise WeightError(f"cannot read {info.key!r}{list(index)} from {info.file}: {e}") from e


def selects(key: str, select: str | None, strip: str) -> bool:
    """Whether `key` belongs to the module; a selected key must start with `strip`."""
    if select is not None and not re.match(select, key):
        return False
    if strip and not key.startswith(strip):
        raise WeightError(f"checkpoint key {key!r} does not start with {strip!r}")
    return True


def selected_tensors(
    checkpoint: str | Path, select: str | None, strip: str
) -> dict[str, TensorInfo]:
    """Header facts of the selected keys, grouped by shard; opens only shards holding them."""
    index, files = _resolve(checkpoint)
    if index is not None:
        wanted: dict[Path, list[str]] = {}
        for key, file in index.items():
            if selects(key, select, strip):
                wanted.setdefault(file, []).append(key)
    else:
        wanted = {file: None for file in files}  # no index: every file's header must be read
    out: dict[str, TensorInfo] = {}
    for file in sorted(wanted):
        with open_shard(file) as handle:
            starts = _data_offsets(file)
            present = set(handle.keys())
            keys = wanted[file]
            if keys is None:
                keys = [k for k in sorted(present) if selects(k, select, strip)]
            for key in keys:
                if key not in present:
                    raise WeightError(f"the index maps {key!r} to {file}, which does not hold it")
                if key in out:
                    raise WeightError(f"key {key!r} is in both {out[key].file} and {file}")
                out[key] = _info(handle, file, key, starts.get(key))
    return out


def _data_offsets(file: Path) -> dict[str, int]:
    """{key: byte offset of its data in `file`} from the header (which `safe_open` has already
    validated: offsets in bounds, no overlap); empty when the header cannot be parsed here, so
    those tensors are read through safetensors."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        return {
            k: 8 + size + int(v["data_offsets"][0])
            for k, v in header.items()
            if k != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return {}


def _info(handle: Any, file: Path, key: str, offset: int | None = None) -> TensorInfo:
    view = handle.get_slice(key)
    code = view.get_dtype()
    if code not in _DTYPES:
        raise WeightError(f"{key!r} in {file} has unsupported dtype {code}")
    return TensorInfo(file, key, tuple(view.get_shape()), jnp.dtype(_DTYPES[code]), offset)


def checkpoint_dtype(
    checkpoint: str | Path, select: str | None = None, strip: str = ""
) -> jnp.dtype:
    """The dtype of the selected float tensors, from the headers alone (build the module at it).

    >>> checkpoint_dtype("model.safetensors", select=r"model\\.visual\\.")  # doctest: +SKIP
    dtype(bfloat16)

    Raises:
      WeightError: no selected float tensor, or the selected float tensors mix dtypes.
    """
    infos = selected_tensors(checkpoint, select, strip).values()
    floats = {i.dtype for i in infos if jnp.issubdtype(i.dtype, jnp.floating)}
    if len(floats) != 1:
        found = sorted(str(d) for d in floats) or "none"
        raise WeightError(f"expected one float dtype among the selected tensors, found {found}")
    return floats.pop()


def read_checkpoint(checkpoint: str | Path) -> Iterator[tuple[str, jax.Array]]:
    """Yields (key, tensor) for every tensor, read onto the host CPU device (bf16 kept as bf16)."""
    infos = selected_tensors(checkpoint, None, "")
    for file in sorted({i.file for i in infos.values()}):
        with open_shard(file) as handle:
            for info in infos.values():
                if info.file == file:
                    yield info.key, jax.device_put(read_tensor(handle, info))
