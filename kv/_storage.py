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
import numpy as np
from safetensors.numpy import save_file

import jaxsync
from jaxsync.check import entry_point
from jaxsync.kv._file_format import Format, check_format, from_tensors, tensor_specs, to_tensors
from jaxsync.kv._ids import check_range, host_ids
from jaxsync.kv._layer_files import (
    check_layer_names,
    check_storable,
    read_tensor,
    writable_folder,
)
from jaxsync.kv._layout import Cache, cache_leaves
from jaxsync.kv._request_rows import (
    layer_leaves,
    per_layer_rows,
    save_shards,
    shard_plan,
    upload_blocks,
    upload_rows,
)
from jaxsync.kv._shards import ShardReader, spans_processes
from jaxsync.kv._slot_plan import check_slots, slot_mapping_for
from jaxsync.kv._slots import extract_kv, inject_kv


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


def _plan(caches: Cache, token_ids: Any, block_ids: Any, root, mm_hashes, buckets=None):
    """Host checks and the request's slots and folder, before any file, upload or compile:
    caches, layer names, ids (ints), block ids inside the cache, slots unique, the key."""
    check_layer_names(caches)
    check_storable(caches)
    tokens = host_ids(token_ids, "token_ids")
    block_size = _block_size(caches)
    num_blocks = jax.tree.leaves(caches)[0].shape[0]
    # the whole table; -1 entries are padding (their tokens are neither saved nor loaded)
    check_range(host_ids(block_ids, "block_ids"), num_blocks, "block_ids", padding=True)
    slots = slot_mapping_for(block_ids, block_size, int(tokens.size))
    check_slots(caches, slots, buckets, unique=True, name="slots of block_ids")
    return slots, kv_folder(root, tokens[: slots.size], mm_hashes)


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
        plan = shard_plan(caches, jaxsync.bucket(int(slots.size)))
        writable_folder(folder)
        save_shards(folder, caches, slots, plan, format)
        return folder
    writable_folder(folder)
    rows = jax.device_get(extract_kv(caches, slots))  # explicit: the one readback, all layers
    layers = layer_leaves(caches)
    for layer, arrays in per_layer_rows(rows, caches).items():
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
    for layer, leaves in layer_leaves(caches).items():
        path = os.path.join(folder, f"{layer}.safetensors")
        if not os.path.exists(path):
            reader = (
                ShardReader(folder, layer, leaves, n, format, read_tensor)
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
            stored = read_tensor(path, name)
            if stored.shape != want or stored.dtype != dtype:
                raise ValueError(
                    f"{path}:{name} is {stored.shape} {stored.dtype}, the cache needs {want} "
                    f"{dtype} ({format!r} format)"
                )
            tensors[name] = stored
        host[layer] = from_tensors(tensors, leaves, format)
    if shards:
        rows = upload_blocks(caches, host, shards, n, size)
    else:
        rows = upload_rows(caches, host, n, size)
    return inject_kv(caches, rows, slots, buckets=buckets)
