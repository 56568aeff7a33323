"""`save_kv` / `load_kv`: a request's KV on disk, one safetensors file per layer (ExampleConnector).

Layout as upstream: `{root}/{md5(token bytes + "-".join(mm_hashes))}/{layer}.safetensors`, one
tensor "kv_cache" in vLLM's layout by default (`format="vllm"`: `[T, K, 2H]` packed rows,
`[2, T, K*H]` for separate K and V, K then V, `[T, L]` MLA rows), or jaxsync's
(`format="jaxsync"`: "k_cache" and "v_cache" for separate K and V; see `_file_format`). The key
hashes the kept tokens (the first `(n - 1) // S * S`, see
`slot_mapping_for`) as int64 bytes, like upstream's `token_ids.numpy().tobytes()`.

A cache spanning several processes (`jax.distributed`) is saved by shards instead: each layer
as one file per block of its rows, `{layer}.shard-{ranges}.safetensors`, each written by a
process holding that block from its own devices (see `_shards`); `load_kv` reads a layer's whole
file when there is one, else each block its process's devices hold from the shard files that
intersect it.

Loading lands on each cache's own device or sharding (upstream hard-codes "cuda") and
never waits on the device: files are read on the host, padded to the slot bucket in fresh host
buffers, uploaded with explicit async puts and injected by one jitted call.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, deserialize, safe_open
from safetensors.numpy import save_file

import jaxsync
from jaxsync.check import entry_point
from jaxsync.kv._file_format import Format, check_format, from_tensors, tensor_specs, to_tensors
from jaxsync.kv._ids import check_range, host_ids
from jaxsync.kv._layout import Cache, StackedCache, cache_leaves
from jaxsync.kv._shards import (
    ShardReader,
    block_leaves,
    index_key,
    row_blocks,
    row_shape,
    shard_name,
    spans_processes,
    write_shard,
)
from jaxsync.kv._slot_plan import check_slots, row_sharding, slot_mapping_for
from jaxsync.kv._slots import extract_kv, inject_kv


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


def _key_hashes(mm_hashes: Any) -> list[str]:
    """The multimodal hashes as a list, refusing what upstream's `"-".join` would mis-key: a
    plain string (joined character by character), non-strings, empty hashes and hashes holding
    the separator (`["a", "b"]`, `["a-b"]` and `"ab"` would share a folder), or NUL (token ids
    below 2**56 end in NUL bytes, so a hash without NUL cannot pass for token bytes)."""
    if isinstance(mm_hashes, str | bytes) or not isinstance(mm_hashes, list | tuple):
        raise TypeError(f"mm_hashes must be a list of str, got {type(mm_hashes).__name__}")
    for h in mm_hashes:
        if not isinstance(h, str):
            raise TypeError(f"mm_hashes must hold str, got {type(h).__name__} {h!r}")
        if not h or "-" in h or "\0" in h:
            raise ValueError(f"mm hash {h!r} is empty or holds '-' or NUL: it would mis-key")
    return list(mm_hashes)


def kv_folder(root: str | os.PathLike, token_ids: Any, mm_hashes: Sequence[str] = ()) -> str:
    """The folder that holds a request's KV: `root/<md5 hex of token bytes + mm hashes>`, as
    upstream keys it (int64 token bytes, then the hashes joined by "-").

    Raises:
      TypeError: token ids that are not ints (floats, bools), mm_hashes not a list of str.
      ValueError: nested token ids, or a hash upstream's key would confuse with another list.

    >>> os.path.basename(kv_folder("/tmp", [1, 2, 3]))
    'aa341a15f5ade44faafbe190f98c2587'
    """
    data = host_ids(token_ids, "token_ids").tobytes()
    hashes = _key_hashes(mm_hashes)
    if hashes:
        data += "-".join(hashes).encode("utf-8")
    try:
        digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
    except ValueError:  # FIPS builds refuse md5 even for non-security use; upstream falls back too
        digest = hashlib.sha256(data).hexdigest()
    return os.path.join(os.fspath(root), digest)


def _block_size(caches: Cache) -> int:
    leaves, _ = cache_leaves(caches, "caches")
    return leaves[0].shape[-2]


def _layers(caches: Cache) -> dict[str, list]:
    """`{layer: [leaf-like per tensor]}` as files store them; a stacked cache's layer l is
    `kv[:, l]` (only shape, dtype and placement are read: no slicing happens here)."""
    if not isinstance(caches, StackedCache):
        return {n: [v] if isinstance(v, jax.Array) else list(v) for n, v in caches.items()}
    leaves = [caches.kv] if isinstance(caches.kv, jax.Array) else list(caches.kv)
    per_layer = [jax.ShapeDtypeStruct((x.shape[0], *x.shape[2:]), x.dtype) for x in leaves]
    return dict.fromkeys(caches.layers, per_layer)


def _per_layer_rows(rows: Any, caches: Cache) -> dict[str, list[np.ndarray]]:
    """Host rows of `extract_kv` by layer (a stacked cache's `[N, L, ...]` split on axis 1)."""
    if not isinstance(caches, StackedCache):
        return {n: [v] if isinstance(v, np.ndarray) else list(v) for n, v in rows.items()}
    leaves = [rows.kv] if isinstance(rows.kv, np.ndarray) else list(rows.kv)
    return {n: [x[:, i] for x in leaves] for i, n in enumerate(caches.layers)}


def _row_arrays(tree: Any, caches: Cache) -> dict[str, tuple[list, int | None]]:
    """`{layer: ([array per leaf], row of the layer axis or None)}` of a cache-shaped tree (the
    cache's leaves, or `extract_kv`'s rows): a stacked tree's layers share its leaves."""
    if not isinstance(caches, StackedCache):
        return {n: ([v] if isinstance(v, jax.Array) else list(v), None) for n, v in tree.items()}
    leaves = [tree.kv] if isinstance(tree.kv, jax.Array) else list(tree.kv)
    return {n: (leaves, i) for i, n in enumerate(caches.layers)}


def _rows_shape(leaf: jax.Array, size: int, stacked: bool) -> tuple:
    """The shape of `size` rows cut from a cache leaf (`[N, (L,) *row axes]`)."""
    per_layer = (leaf.shape[0], *leaf.shape[2:]) if stacked else leaf.shape
    layer_axis = (leaf.shape[1],) if stacked else ()
    return (size, *layer_axis, *row_shape(jax.ShapeDtypeStruct(per_layer, leaf.dtype)))


def _shard_plan(caches: Cache, size: int) -> dict[str, dict]:
    """`{layer: {ranges: (index key, owner process)}}`: the blocks of each layer's rows (as
    `row_sharding` cuts them from the cache), the same for a layer's k and v (ValueError else)."""
    stacked = isinstance(caches, StackedCache)
    plan = {}
    for layer, (leaves, pos) in _row_arrays(caches, caches).items():
        blocks = [row_blocks(_rows_shape(x, size, stacked), row_sharding(x), pos) for x in leaves]
        if any(set(b) != set(blocks[0]) for b in blocks):
            raise ValueError(f"layer {layer!r}: k and v are sharded differently; cannot save")
        plan[layer] = blocks[0]
    return plan


def _save_shards(folder: str, caches: Cache, slots: np.ndarray, plan: dict, format: Format):
    """Writes the blocks this process owns (see `_shards`), from its own devices' rows only."""
    rows = extract_kv(caches, slots)
    me, n = jax.process_index(), int(slots.size)
    layers = _layers(caches)
    wanted, fetch = [], []
    for layer, (arrays, pos) in _row_arrays(rows, caches).items():
        for ranges, (key, owner) in plan[layer].items():
            if owner != me:
                continue
            for x in arrays:
                shards = {index_key(sh.index, x.shape): sh for sh in x.addressable_shards}
                fetch.append(shards[key].data)
            wanted.append((layer, ranges, pos, key, len(arrays)))
    host = iter(jax.device_get(fetch))  # explicit: this process's own blocks, one readback
    for layer, ranges, pos, key, count in wanted:
        kept = [next(host)[:n] for _ in range(count)]
        if pos is not None:
            kept = [a[:, pos - key[1][0]] for a in kept]
        leaves = block_leaves(layers[layer], ranges)
        whole = row_shape(layers[layer][0])
        path = os.path.join(folder, shard_name(layer, ranges))
        write_shard(path, to_tensors(kept, leaves, format), layer, ranges, whole, format)


def _check_storable(caches: Cache) -> None:
    """Every leaf's dtype is one a safetensors file can hold (checked before any gather, so an
    unsupported cache never leaves a half-written folder behind)."""
    for dtype in {np.dtype(x.dtype) for x in jax.tree.leaves(caches)}:
        if dtype.name not in _STORABLE:
            raise TypeError(f"a KV file cannot hold {dtype.name}; supported: {sorted(_STORABLE)}")


def _check_layer_names(caches: Cache) -> None:
    for name in caches.layers if isinstance(caches, StackedCache) else caches:
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {type(name).__name__} {name!r}")
        if not name or "/" in name or os.sep in name or "\0" in name or name in (".", ".."):
            raise ValueError(f"layer name {name!r} cannot be a file name")


def _plan(caches: Cache, token_ids: Any, block_ids: Any, root, mm_hashes, buckets=None):
    """Host checks and the request's slots and folder, before any file, upload or compile:
    caches, layer names, ids (ints), block ids inside the cache, slots unique, the key."""
    _check_layer_names(caches)
    _check_storable(caches)
    tokens = host_ids(token_ids, "token_ids")
    block_size = _block_size(caches)
    num_blocks = jax.tree.leaves(caches)[0].shape[0]
    # the whole table; -1 entries are padding (their tokens are neither saved nor loaded)
    check_range(host_ids(block_ids, "block_ids"), num_blocks, "block_ids", padding=True)
    slots = slot_mapping_for(block_ids, block_size, int(tokens.size))
    check_slots(caches, slots, buckets, unique=True, name="slots of block_ids")
    return slots, kv_folder(root, tokens[: slots.size], mm_hashes)


def _writable_folder(folder: str) -> None:
    """Creates `folder` (an OSError such as NotADirectoryError if its parent is a file) and
    checks it is writable, before anything is gathered or read back."""
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write KV files into {folder}")


def _read(path: str, name: str) -> np.ndarray:
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


def save_kv(
    root: str | os.PathLike,
    caches: Cache,
    token_ids: Any,
    block_ids: Any,
    *,
    mm_hashes: Sequence[str] = (),
    format: Format = "vllm",
) -> str | None:
    """Saves a request's KV rows, one safetensors file per layer.

    Writing a file needs the data on the host, so this call waits for it (upstream's `.cpu()`
    does too); the gather itself is `extract_kv`, sync-free, and all layers are fetched with one
    `jax.device_get`. A cache spanning several processes is saved by every process, each writing
    the blocks of rows its own devices hold (one file per block, `{layer}.shard-{ranges}.
    safetensors`; see `jaxsync.kv._shards`), fetching only its own devices' data.

    Args:
      root: storage root; the request folder is created under it.
      caches: `{layer: cache}` in device memory.
      token_ids: the request's token ids (host).
      block_ids: its block table (host); a -1 entry is padding: its tokens' rows are saved as
        zeros, and a load with -1 there writes nothing.
      mm_hashes: multimodal hashes mixed into the folder key.
      format: "vllm" (vLLM's ExampleConnector layout: one "kv_cache" per layer, `[T, K, 2H]`
        packed, `[2, T, K*H]` K then V for a (k, v) pair, `[T, L]` MLA; vLLM loads these
        files) or "jaxsync" (a (k, v) pair as "k_cache" and "v_cache", `[T, K, H]` each).

    Returns:
      The folder written, or None when no whole block is kept (nothing to save).

    Raises (before anything is gathered or read back):
      TypeError / ValueError: as `load_kv`, for ids, hashes, caches and layer names.
      OSError: the folder cannot be created or written (e.g. NotADirectoryError when `root` is
        a file, PermissionError).
      ValueError: (a cache spanning processes) k and v sharded differently, or rows that would
        be split over tokens.
    """
    check_format(format)
    slots, folder = _plan(caches, token_ids, block_ids, root, mm_hashes)
    if slots.size == 0:
        return None
    if spans_processes(jax.tree.leaves(caches)):
        plan = _shard_plan(caches, jaxsync.bucket(int(slots.size)))
        _writable_folder(folder)
        _save_shards(folder, caches, slots, plan, format)
        return folder
    _writable_folder(folder)
    rows = jax.device_get(extract_kv(caches, slots))  # explicit: the one readback, all layers
    layers = _layers(caches)
    for layer, arrays in _per_layer_rows(rows, caches).items():
        kept = [a[: slots.size] for a in arrays]
        tensors = to_tensors(kept, layers[layer], format)
        save_file(tensors, os.path.join(folder, f"{layer}.safetensors"))
    return folder


@entry_point
def load_kv(
    root: str | os.PathLike,
    caches: Cache,
    token_ids: Any,
    block_ids: Any,
    *,
    mm_hashes: Sequence[str] = (),
    buckets: tuple[int, ...] | None = None,
    format: Format = "vllm",
) -> Cache:
    """Loads a request's KV rows saved by `save_kv` into `caches` (donated), without waiting.

    Args:
      root: storage root used by `save_kv`.
      caches: `{layer: cache}` in device memory; each layer's rows land on its own sharding
        (from a layer's whole file, or, without one, from the shard files of a save by shards).
      token_ids, block_ids, mm_hashes: as for `save_kv` (block ids may differ from the save).
      buckets: slot-count buckets (default: powers of two >= 8).
      format: the files' layout, as for `save_kv` ("vllm": files vLLM's connector wrote load).

    Returns:
      The updated caches (`caches` itself when no whole block is kept).

    Raises (all before anything is uploaded or compiled; caches untouched):
      TypeError: token or block ids that are not ints, mm_hashes not a list of str, a cache
        dtype safetensors cannot store (int4, float4, float8_e4m3b11fnuz, ...).
      ValueError: block ids outside the cache or repeated, a hash that would mis-key (see
        `kv_folder`), a file that is not valid safetensors (truncated, corrupt, missing a
        tensor), or a stored tensor whose shape or dtype does not fit the cache.
      FileNotFoundError: a layer has neither a file nor shard files.
      ValueError (shard files, see `save_kv`): a block this process's devices hold that the
        saved blocks do not cover, a shard file that is corrupt, whose metadata disagrees with
        its name, or saved from a cache of other row shapes.
    """
    check_format(format)
    slots, folder = _plan(caches, token_ids, block_ids, root, mm_hashes, buckets)
    n = int(slots.size)
    if n == 0:
        return caches
    size = jaxsync.bucket(n, buckets)
    host: dict[str, list[np.ndarray]] = {}
    shards: dict[str, ShardReader] = {}
    for layer, leaves in _layers(caches).items():
        path = os.path.join(folder, f"{layer}.safetensors")
        if not os.path.exists(path):
            reader = (
                ShardReader(folder, layer, leaves, n, format, _read)
                if os.path.isdir(folder)
                else None
            )
            if not reader:
                raise FileNotFoundError(f"no saved KV for layer {layer!r}: {path}")
            reader.check_bounds()
            shards[layer] = reader
            continue
        tensors = {}
        for name, (want, dtype) in tensor_specs(leaves, n, format).items():
            stored = _read(path, name)
            if stored.shape != want or stored.dtype != dtype:
                raise ValueError(
                    f"{path}:{name} is {stored.shape} {stored.dtype}, the cache needs {want} "
                    f"{dtype} ({format!r} format)"
                )
            tensors[name] = stored
        host[layer] = from_tensors(tensors, leaves, format)
    if shards:
        rows = _upload_blocks(caches, host, shards, n, size)
    else:
        rows = _upload_rows(caches, host, n, size)
    return inject_kv(caches, rows, slots, buckets=buckets)


def _upload_blocks(caches, host, shards, n: int, size: int) -> Cache:
    """Rows uploaded block by block, each leaf on its row sharding: every block this process's
    devices hold is built on the host (from a layer's whole file, or from the shard files that
    intersect it) before any is uploaded, so a missing or bad file leaves the caches untouched."""
    stacked = isinstance(caches, StackedCache)
    blocks: dict[tuple, np.ndarray] = {}
    shard_rows: dict[tuple, list[np.ndarray]] = {}

    def layer_rows(layer: str, leaf: int, ranges: tuple) -> np.ndarray:
        if layer in host:
            return host[layer][leaf][(slice(None), *(slice(a, b) for a, b in ranges))]
        if (layer, ranges) not in shard_rows:
            shard_rows[layer, ranges] = shards[layer].rows(ranges)
        return shard_rows[layer, ranges][leaf]

    names = list(caches.layers) if stacked else None
    arrays = _row_arrays(caches, caches)
    targets = []  # (layer or None, leaf number, cache leaf)
    if stacked:
        targets = [(None, i, x) for i, x in enumerate(next(iter(arrays.values()))[0])]
    else:
        targets = [(lay, i, x) for lay, (xs, _) in arrays.items() for i, x in enumerate(xs)]
    puts = []
    for layer, i, x in targets:
        shape, sharding = _rows_shape(x, size, stacked), row_sharding(x)
        for index in sharding.addressable_devices_indices_map(shape).values():
            key = index_key(index, shape)
            if (id(x), key) in blocks:
                continue
            if stacked:
                (a, b), rest = key[1], key[2:]
                part = np.stack([layer_rows(names[j], i, rest) for j in range(a, b)], axis=1)
            else:
                part = layer_rows(layer, i, key[1:])
            padded = np.zeros((size, *part.shape[1:]), part.dtype)
            padded[:n] = part
            blocks[id(x), key] = padded
        puts.append((layer, i, x, shape, sharding))

    def put(x, shape, sharding):
        def block(index):
            return blocks[id(x), index_key(index, shape)]

        return jax.make_array_from_callback(shape, sharding, block)

    if stacked:
        out = [put(x, shape, sharding) for _, _, x, shape, sharding in puts]
        return StackedCache(
            out[0] if isinstance(caches.kv, jax.Array) else tuple(out), caches.layers
        )
    kv: dict[str, Any] = {}
    for layer, value in caches.items():
        got = [put(x, shape, sharding) for lay, _, x, shape, sharding in puts if lay == layer]
        kv[layer] = got[0] if isinstance(value, jax.Array) else type(value)(got)
    return kv


def _upload_rows(caches: Cache, host: dict[str, list[np.ndarray]], n: int, size: int) -> Cache:
    """The checked rows padded to the bucket in fresh host buffers (nobody mutates them after,
    so the async put may alias them) and uploaded, one put per cache leaf, each on its leaf's
    row sharding; a stacked cache's layers are stacked on the host first."""

    def put(rows: np.ndarray, leaf: jax.Array) -> jax.Array:
        padded = np.zeros((size, *rows.shape[1:]), rows.dtype)
        padded[:n] = rows
        return jaxsync.async_h2d(padded, placement=row_sharding(leaf), copy=False)

    if isinstance(caches, StackedCache):
        leaves = [caches.kv] if isinstance(caches.kv, jax.Array) else list(caches.kv)
        stacked = [
            np.stack([host[n][i] for n in caches.layers], axis=1) for i in range(len(leaves))
        ]
        puts = [put(rows, x) for rows, x in zip(stacked, leaves, strict=True)]
        return StackedCache(puts[0] if len(puts) == 1 else tuple(puts), caches.layers)
    kv = {}
    for layer, value in caches.items():
        leaves = [value] if isinstance(value, jax.Array) else list(value)
        puts = [put(rows, x) for rows, x in zip(host[layer], leaves, strict=True)]
        kv[layer] = puts[0] if isinstance(value, jax.Array) else type(value)(puts)
    return kv
