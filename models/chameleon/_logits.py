# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Image-token logit mask: every `IMGIMG` id gets `finfo(dtype).min`, so text decoding never emits
raw image tokens (the begin/end-image specials are not masked).

vLLM pre-PR indexed with a Python list (a host-built index and a blocking upload per call);
post-PR caches the index per device and uses `index_fill_`. Here a `[V]` boolean column mask is
a `DeviceCache` constant and the fill is one `jnp.where`, in place when the caller donates. A
select over every column rather than a scatter of the image columns: bit-identical, one fused
elementwise pass that XLA can do in place, where a scatter of thousands of columns is a slow path
on some backends.

Pure functions for a server's own jitted step or `shard_map` (the cached mask passed in, or
closed over): `mask_image_logits(logits, mask_column)` and
`compute_logits(hidden, lm_head_weight, mask_column)`, with `mask_column` from
`ChameleonImageEncoder.mask_column(vocab_size)`. They add no jit argument besides the mask and
no host callback. The encoder's methods of the same names are the standalone entry points.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxsync.models.chameleon._vocab import check_device_array


def mask_image_logits(
    logits: Float[Array, "*B T V"], mask_column: Bool[Array, " V"]
) -> Float[Array, "*B T V"]:
    """`finfo(logits.dtype).min` at every column where `mask_column` is True (pure)."""
    return jnp.where(mask_column, jnp.finfo(logits.dtype).min, logits)


def compute_logits(
    hidden: Float[Array, "*B T D"],
    lm_head_weight: Float[Array, "V D"],
    mask_column: Bool[Array, " V"],
) -> Float[Array, "*B T V"]:
    """`hidden @ lm_head_weight.T` with the image columns masked (pure)."""
    logits = jnp.einsum("...d,vd->...v", hidden, lm_head_weight)  # [..., V]
    return mask_image_logits(logits, mask_column)


mask_jit = jax.jit(mask_image_logits)
mask_jit_donated = jax.jit(mask_image_logits, donate_argnums=0)
compute_logits_jit = jax.jit(compute_logits)


def check_logits(logits, max_image_id: int, name: str = "logits") -> None:
    """Host checks of device logits `[T, V]` / `[B, T, V]` (shape metadata only, no sync)."""
    check_device_array(logits, name)
    if logits.ndim not in (2, 3):
        raise ValueError(f"{name} must be 2-D [T, V] or 3-D [B, T, V], got shape {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got {logits.dtype}")
    if logits.shape[-1] <= max_image_id:
        raise ValueError(
            f"{name} vocab {logits.shape[-1]} does not cover the largest image token id "
            f"{max_image_id}"
        )


def check_lm_head(hidden, lm_head_weight, max_image_id: int) -> None:
    """Host checks of `compute_logits`' inputs (shape metadata only, no sync)."""
    check_device_array(hidden, "hidden")
    check_device_array(lm_head_weight, "lm_head_weight")
    if hidden.ndim not in (2, 3):
        raise ValueError(f"hidden must be [T, D] or [B, T, D], got shape {hidden.shape}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, {hidden.shape[-1]}], got shape {lm_head_weight.shape}"
        )
    if hidden.dtype != lm_head_weight.dtype:
        raise TypeError(f"dtype mismatch: hidden {hidden.dtype}, lm_head {lm_head_weight.dtype}")
    if lm_head_weight.shape[0] <= max_image_id:
        raise ValueError(
            f"lm_head vocab {lm_head_weight.shape[0]} does not cover the largest image token "
            f"id {max_image_id}"
        )
