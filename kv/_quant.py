"""fp8 KV caches with scales (vLLM's `kv_cache_dtype="fp8"`, e4m3 or e5m2): quantizing writes,
dequantizing reads, and MLA rows made of two parts (`concat_and_cache_mla`).

A write stores `x / scale`, computed in float32, saturated to the fp8 type's finite range and
cast with round-to-nearest-even; a read gives `float32(q) * scale` cast to the compute dtype.
That is vLLM's scaled conversion, so a cache written here reads the same in vLLM and back.
`k_scale` / `v_scale` are float32 device arrays, one per tensor (`[]`) or per kv head (`[K]`);
a packed `[P, K, S, 2H]` leaf takes k's scale on its first H lanes and v's on the last H, an MLA
leaf one scale (`k`). Their values stay on the device: they are arguments of the program, never
read on the host, so a new scale neither syncs nor compiles.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from typing import Any

import jax
import jax.numpy as jnp

from jaxsync.kv._layout import Cache, StackedCache


FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
"""Cache dtypes that take scales (vLLM's "fp8" / "fp8_e4m3" and "fp8_e5m2")."""


@ft.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVScales:
    """The scales of an fp8 cache (vLLM's `k_scale` / `v_scale`).

    Attributes:
      k: float32 `[]` (per tensor) or `[K]` (per kv head) on the device; an MLA cache's one
        scale.
      v: the same for values; None for MLA caches.
    """

    k: jax.Array
    v: jax.Array | None = None


Scales = KVScales | dict[str, KVScales]  # one for every layer, or one per layer name


def _check_scale(scale: Any, what: str, heads: int | None) -> None:
    if not isinstance(scale, jax.Array):
        raise TypeError(
            f"{what} must be a float32 jax.Array on the device (a host value would be read into "
            f"the program as a constant), got {type(scale).__name__}"
        )
    if scale.dtype != jnp.float32:
        raise TypeError(f"{what} must be float32, got {scale.dtype}")
    if not isinstance(scale, jax.core.Tracer) and scale.is_deleted():
        raise ValueError(f"{what} is a deleted (donated) array")
    shapes = [()] if heads is None else [(), (heads,)]
    if tuple(scale.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{what} must have shape {want}, got {list(scale.shape)}")


def _layer_scales(scales: Scales, name: str) -> KVScales:
    if isinstance(scales, dict):  # its layer names were checked against the cache's
        scales = scales[name]
    if not isinstance(scales, KVScales):
        raise TypeError(f"scales must be KVScales or a dict of them, got {type(scales).__name__}")
    return scales


def _map_layers(fn, cache: Cache, scales: Scales, *trees: Cache) -> Cache:
    """`fn(value, *tree_values, layer_scales, heads_axis)` per layer (value: an array or a
    (k, v) pair), rebuilt in the cache's structure. `heads_axis`: where K sits in a leaf
    (None for MLA)."""
    if isinstance(cache, StackedCache):
        if isinstance(scales, dict):
            raise TypeError("a StackedCache takes one KVScales for all its layers")
        value = cache.kv
        out = fn(value, *(t.kv for t in trees), _layer_scales(scales, ""), _heads_axis(value, 2))
        return StackedCache(out, cache.layers)
    if isinstance(scales, dict) and set(scales) != set(cache):
        raise ValueError(f"scales name layers {sorted(scales)}, the cache {sorted(cache)}")
    return {
        name: fn(
            value, *(t[name] for t in trees), _layer_scales(scales, name), _heads_axis(value, 1)
        )
        for name, value in cache.items()
    }


def _heads_axis(value: Any, first: int) -> int | None:
    """K's axis in a leaf (`first` after the block axis and any layer axis), None for MLA."""
    leaf = value[0] if isinstance(value, tuple | list) else value
    return first if leaf.ndim == first + 3 else None


def check_scales(cache: Cache, scales: Scales) -> None:
    """Scales fit the cache: an fp8 cache, float32 `[]` / `[K]` device arrays, v's scale for
    attention layers and none for MLA. Raises TypeError / ValueError (host, or while tracing)."""

    def one(value, s: KVScales, axis):
        leaves = list(value) if isinstance(value, tuple | list) else [value]
        for leaf in leaves:
            if leaf.dtype not in FP8:
                raise ValueError(
                    f"scales need an fp8 cache ({' or '.join(map(str, FP8))}), got {leaf.dtype}"
                )
        heads = None if axis is None else leaves[0].shape[axis]
        _check_scale(s.k, "k_scale", heads)
        if axis is None:
            if s.v is not None:
                raise ValueError("an MLA cache takes one scale (KVScales(k)); v must be None")
        else:
            _check_scale(s.v, "v_scale", heads)
        return value

    _map_layers(one, cache, scales)


def _broadcast(scale: jax.Array, rows: jax.Array) -> jax.Array:
    """`scale` (`[]` or `[K]`) shaped to broadcast against rows `[N, (L,) K, X]` / `[N, L]`."""
    if scale.ndim == 0:
        return scale.reshape((1,) * rows.ndim)
    return scale.reshape((1,) * (rows.ndim - 2) + (scale.shape[0], 1))


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """vLLM's scaled fp8 conversion: float32 `x / scale`, saturated, cast to nearest even."""
    top = float(jnp.finfo(dtype).max)  # a property of the type, not of device data
    # XLA turns a division by a broadcast scalar into a product with its reciprocal, which
    # lands on the other side of a rounding tie for some quotients (vLLM's kernel divides). A
    # divisor the simplifier cannot see through keeps the true quotient.
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(_broadcast(scale, x), x.shape))
    y = x.astype(jnp.float32) / divisor
    return jnp.clip(y, -top, top).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """vLLM's dequantizing read: `float32(q) * scale` cast to `dtype`."""
    return (q.astype(jnp.float32) * _broadcast(scale, q)).astype(dtype)


def _per_part(convert, rows_value, s: KVScales, axis, dtype):
    """`convert(rows, scale, dtype)` on one layer's rows: k and v parts with their own scale."""
    if isinstance(rows_value, tuple | list):
        k, v = rows_value
        return type(rows_value)((convert(k, s.k, dtype), convert(v, s.v, dtype)))
    if axis is None:  # MLA: one scale for the whole row
        return convert(rows_value, s.k, dtype)
    half = rows_value.shape[-1] // 2  # packed: K's head dim, then V's
    k, v = rows_value[..., :half], rows_value[..., half:]
    return jnp.concatenate([convert(k, s.k, dtype), convert(v, s.v, dtype)], axis=-1)


def quantize_rows(cache: Cache, rows: Cache, scales: Scales) -> Cache:
    """Per-token rows of a compute dtype, quantized into the cache's fp8 dtype."""

    def one(value, rows_value, s, axis):
        dtype = (value[0] if isinstance(value, tuple | list) else value).dtype
        return _per_part(quantize, rows_value, s, axis, dtype)

    return _map_layers(one, cache, scales, rows)


def dequantize_rows(cache: Cache, rows: Cache, scales: Scales, dtype: Any) -> Cache:
    """Per-token fp8 rows read from the cache, dequantized to `dtype`."""

    def one(value, rows_value, s, axis):
        return _per_part(dequantize, rows_value, s, axis, dtype)

    return _map_layers(one, cache, scales, rows)
