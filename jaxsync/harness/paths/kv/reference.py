"""PyTorch references of the upstream KV semantics, shared by tests, `verify` and the benchmarks.

torch is imported lazily inside each function: it is a test/bench dependency only. The references
follow vLLM: `copy_kv_blocks` is `dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))` per
layer with int64 ids; the ExampleConnector gathers `layer[slot // S, :, slot % S]` (attention) or
`layer.reshape(P * S, -1)[slot]` (MLA) and scatters with the same indexing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_torch(x: Any):
    """A host torch tensor with the same bits as a jax/numpy array (bf16 included)."""
    import torch

    if isinstance(x, jax.Array):
        if (x.sharding.memory_kind or "device") != "device":
            x = jax.device_put(x, x.sharding.with_memory_kind("device"))
        x = jax.device_get(x)
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    if a.dtype.name in _FLOAT8:  # numpy has no float8: move the bytes
        return torch.from_numpy(a.view(np.uint8).copy()).view(getattr(torch, a.dtype.name))
    return torch.from_numpy(a.copy())


_FLOAT8 = ("float8_e4m3fn", "float8_e5m2")


def to_numpy(t) -> np.ndarray:
    """Inverse of `to_torch` (bf16 and float8 come back as ml_dtypes types)."""
    import ml_dtypes
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    for name in _FLOAT8:
        if t.dtype == getattr(torch, name):
            return t.view(torch.uint8).numpy().view(getattr(ml_dtypes, name))
    return t.numpy()


def torch_copy_blocks(src: dict, dst: dict, src_ids, dst_ids) -> dict:
    """vLLM's copy: per layer (and per k/v leaf), dst[dst_ids] = src[src_ids], on copies."""
    import torch

    s_idx = torch.tensor(np.asarray(src_ids), dtype=torch.int64)
    d_idx = torch.tensor(np.asarray(dst_ids), dtype=torch.int64)

    def one(s, d):
        out = to_torch(d)
        out.index_copy_(0, d_idx, to_torch(s).index_select(0, s_idx))
        return out

    return jax.tree.map(one, src, dst)


def torch_extract(leaf: Any, slots) -> Any:
    """ExampleConnector.extract_kv_from_layer on a torch copy of `leaf`."""
    import torch

    t = to_torch(leaf)
    slot = torch.tensor(np.asarray(slots), dtype=torch.int64)
    if t.ndim == 3:  # MLA [P, S, L]
        return t.reshape(t.shape[0] * t.shape[1], -1)[slot]
    return t[slot // t.shape[2], :, slot % t.shape[2]]


def torch_inject(leaf: Any, rows: Any, slots) -> Any:
    """ExampleConnector.inject_kv_into_layer on a torch copy of `leaf`."""
    import torch

    t = to_torch(leaf)
    r = to_torch(rows)
    slot = torch.tensor(np.asarray(slots), dtype=torch.int64)
    if t.ndim == 3:
        flat = t.reshape(t.shape[0] * t.shape[1], -1)
        flat[slot] = r
        return flat.reshape(t.shape)
    t[slot // t.shape[2], :, slot % t.shape[2]] = r
    return t


def torch_copy_pattern(device: str):
    """vLLM's post-PR block copy on `device`: ids pinned + non_blocking, index_select/index_copy_.

    Returns `copy(src_layers, dst_layers, src_ids, dst_ids)` over lists of torch tensors.
    """
    import torch

    pin = device.startswith("cuda")

    def upload(ids):
        host = torch.tensor(ids, dtype=torch.int64, device="cpu", pin_memory=pin)
        return host.to(device, non_blocking=True)

    def copy(src_layers, dst_layers, src_ids, dst_ids):
        s_idx, d_idx = upload(src_ids), upload(dst_ids)
        for s, d in zip(src_layers, dst_layers, strict=True):
            d.index_copy_(0, d_idx, s.index_select(0, s_idx))
        return dst_layers

    return copy


def as_numpy(x: jax.Array) -> np.ndarray:
    """Host copy of a jax array in any memory kind (reads a pinned-host array via device memory)."""
    if (x.sharding.memory_kind or "device") != "device":
        x = jax.device_put(x, x.sharding.with_memory_kind("device"))
    return np.array(jax.device_get(x))


def host_random_cache(layout, layers, seed: int, placement=None) -> dict:
    """A cache of host-drawn random values (cheap: no compile per value, unlike
    `KVLayout.random`), placed with `placement` (default device when None)."""
    rng = np.random.default_rng(seed)

    def leaf():
        if np.issubdtype(np.dtype(layout.dtype), np.integer):
            x = rng.integers(-128, 128, layout.leaf_shape).astype(layout.dtype)
        else:
            x = rng.standard_normal(layout.leaf_shape).astype(np.float32).astype(layout.dtype)
        return jax.device_put(x, placement or jax.devices()[0])

    pair = layout.kind == "separate"
    return {name: (leaf(), leaf()) if pair else leaf() for name in layers}
