"""A request's KV saved and loaded by shards: the layout of a cache spread over processes.

A cache whose sharding spans devices of several processes (`jax.distributed`) cannot be fetched
whole by any one process. `save_kv` then writes, per layer, one file per distinct block of the
layer's rows (the per-token rows `extract_kv` gives, `[T, K, X]` or `[T, L]`, sharded over heads
or latents as the cache is; tokens are never split):

    {folder}/{layer}.shard-{a0}-{b0}_{a1}-{b1}....safetensors

where `a_i:b_i` is the block's range of row axis i + 1 (the axes after tokens: kv heads and head
dim, or the latent). A block is written by the lowest-numbered process holding it, from that
process's own device data, so every block is written once and no process reads another's. The
file holds the block's rows in the request's format (`tensor_specs` of a cache of the block's
size: "vllm" `[T, k, 2H]`, `[2, T, k*H]`, `[T, l]`; "jaxsync" `k_cache` / `v_cache`), and its
metadata records the layer, the block's ranges, the layer's whole row shape and the format; a
file whose name and metadata disagree is refused.

`load_kv` builds each destination block its process's devices hold from the shard files that
intersect it (the files of other blocks are not opened), so a save loads into the same mesh, a
mesh of other process counts, or one process, whenever the saved blocks cover the blocks wanted;
it refuses, before anything is uploaded, a layer whose saved blocks do not cover them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxsync.kv._file_format import Format, from_tensors, tensor_specs


Ranges = tuple[tuple[int, int], ...]  # one (start, stop) per row axis after the token axis

_META = "jaxsync.kv.shard"
_NAME = re.compile(r"(?P<layer>.+)\.shard-(?P<ranges>\d+-\d+(?:_\d+-\d+)*)\.safetensors")


def spans_processes(leaves: list) -> bool:
    """Whether any cache leaf lives partly on devices of other processes."""
    return any(not x.sharding.is_fully_addressable for x in leaves)


def index_key(index: tuple, shape: tuple) -> tuple:
    """A block index as `((start, stop), ...)` over every axis of `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def shard_name(layer: str, ranges: Ranges) -> str:
    return f"{layer}.shard-{'_'.join(f'{a}-{b}' for a, b in ranges)}.safetensors"


def row_blocks(shape: tuple, sharding: Any, layer: int | None, addressable: bool = False) -> dict:
    """`{ranges: (index key, owner process)}` of one layer's blocks of a rows array of `shape`
    (`[N, ...]`, or `[N, L, ...]` stacked with `layer` its row of axis 1); the owner is the
    lowest process holding the block. `addressable`: only blocks this process's devices hold."""
    devices = (
        sharding.addressable_devices_indices_map(shape)
        if addressable
        else sharding.devices_indices_map(shape)
    )
    out: dict[Ranges, tuple[tuple, int]] = {}
    for device, index in devices.items():
        key = index_key(index, shape)
        if key[0] != (0, shape[0]):
            raise ValueError(f"KV rows sharded over tokens ({sharding}) cannot be saved by shards")
        rest = key[1:]
        if layer is not None:
            if not rest[0][0] <= layer < rest[0][1]:
                continue
            rest = rest[1:]
        held = out.get(rest)
        if held is None or device.process_index < held[1]:
            out[rest] = (key, device.process_index)
    return out


def block_leaves(leaves: list, ranges: Ranges) -> list:
    """The per-layer leaves of a cache holding just the block `ranges` of each row axis: row
    axes are the leaf's axes after blocks except its slot axis (`[P, K, S, X]` -> `K, X`)."""
    sizes = [b - a for a, b in ranges]
    return [
        jax.ShapeDtypeStruct((x.shape[0], *sizes[:-1], x.shape[-2], sizes[-1]), x.dtype)
        for x in leaves
    ]


def row_shape(leaf: Any) -> tuple:
    """A per-layer leaf's row axes after tokens (`[P, K, S, X]` -> `(K, X)`)."""
    return (*leaf.shape[1:-2], leaf.shape[-1])


def write_shard(path: str, tensors: dict, layer: str, ranges: Ranges, whole: tuple, format: Format):
    from safetensors.numpy import save_file

    meta = {"layer": layer, "ranges": [list(r) for r in ranges], "rows": list(whole)}
    save_file(tensors, path, metadata={_META: json.dumps(meta), "format": format})


class ShardReader:
    """One layer's shard files in a request folder, read lazily: `rows(ranges)` gives the rows
    (per leaf, `[n, *block]`) of a block assembled from the files intersecting it."""

    def __init__(self, folder: str, layer: str, leaves: list, n: int, format: Format, read):
        self.folder, self.layer, self.leaves, self.n, self.format = folder, layer, leaves, n, format
        self.read: Callable[[str, str], np.ndarray] = read
        self.whole = row_shape(leaves[0])
        self.files: dict[Ranges, str] = {}
        for name in sorted(os.listdir(folder)):
            m = _NAME.fullmatch(name)
            if m and m["layer"] == layer:
                ranges = tuple(tuple(int(v) for v in r.split("-")) for r in m["ranges"].split("_"))
                self.files[ranges] = os.path.join(folder, name)
        self.cache: dict[Ranges, list[np.ndarray]] = {}

    def __bool__(self) -> bool:
        return bool(self.files)

    def _check(self, ranges: Ranges, path: str) -> None:
        try:
            with safe_open(path, framework="numpy") as f:
                meta = json.loads((f.metadata() or {})[_META])
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a readable KV shard file: {e}") from e
        recorded = (meta.get("layer"), tuple(tuple(r) for r in meta.get("ranges", ())))
        if recorded != (self.layer, ranges):
            raise ValueError(
                f"{path} records layer {recorded[0]!r} block {recorded[1]}, not its name's"
            )
        if tuple(meta.get("rows", ())) != self.whole:
            raise ValueError(
                f"{path} holds a block of rows shaped {tuple(meta.get('rows', ()))}, this cache's "
                f"layer {self.layer!r} has rows {self.whole} (saved from another cache)"
            )

    def _file_rows(self, ranges: Ranges) -> list[np.ndarray]:
        if ranges not in self.cache:
            path = self.files[ranges]
            self._check(ranges, path)
            leaves = block_leaves(self.leaves, ranges)
            tensors = {}
            for name, (want, dtype) in tensor_specs(leaves, self.n, self.format).items():
                stored = self.read(path, name)
                if stored.shape != want or stored.dtype != dtype:
                    raise ValueError(
                        f"{path}:{name} is {stored.shape} {stored.dtype}, the block needs {want} "
                        f"{dtype} ({self.format!r} format)"
                    )
                tensors[name] = stored
            self.cache[ranges] = from_tensors(tensors, leaves, self.format)
        return self.cache[ranges]

    def check_bounds(self) -> None:
        """Every file's ranges lie inside the layer's rows (checked before any is read)."""
        for ranges, path in self.files.items():
            if len(ranges) != len(self.whole) or any(
                not 0 <= a < b <= n for (a, b), n in zip(ranges, self.whole, strict=False)
            ):
                raise ValueError(f"{path} names a block outside rows {self.whole}")

    def rows(self, ranges: Ranges) -> list[np.ndarray]:
        """Per leaf, the `[n, *block]` rows of block `ranges`, from the files intersecting it."""
        sizes = tuple(b - a for a, b in ranges)
        out = [np.empty((self.n, *sizes), x.dtype) for x in self.leaves]
        covered = np.zeros(sizes, bool)
        for saved in self.files:
            cut = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(ranges, saved, strict=True)]
            if any(lo >= hi for lo, hi in cut):
                continue
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(cut, ranges, strict=True))
            src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(cut, saved, strict=True))
            for o, r in zip(out, self._file_rows(saved), strict=True):
                o[(slice(None), *dst)] = r[(slice(None), *src)]
            covered[dst] = True
        if not covered.all():
            have = sorted(self.files)
            raise ValueError(
                f"no saved KV of layer {self.layer!r} covers its block {ranges} in "
                f"{self.folder}: saved blocks {have} (a process's files missing, or saved "
                f"under a sharding whose blocks do not cover this one's)"
            )
        return out
