# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Image-token logit mask: every `IMGIMG` id gets `finfo(dtype).min`, so text decoding never emits
raw image tokens (the begin/end-image specials are not masked).

vLLM pre-PR indexed with a Python list (a host-built index and a blocking upload per call);
post-PR caches the index per device and uses `index_fill_`. Here a `[V]` boolean column mask is
a `DeviceCache` constant and the fill is one `jnp.where` inside jit, in place when the caller
donates. A select over every column, not a scatter of the image columns: bit-identical, and
where a scatter is slow it is 1.5-45x faster (XLA:CPU, `tools/explore_mask.py`, [T, 65536] bf16,
T = 1..256); on an H200 both are one kernel at the per-program floor (0.03-0.04 ms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

import jaxsync
import jaxsync.check
from jaxsync import replicated_near
from jaxsync.models.chameleon._vocab import ImageVocabularyMapping


def _fill(logits: Float[Array, "*B T V"], mask: Bool[Array, " V"]) -> Float[Array, "*B T V"]:
    return jnp.where(mask, jnp.finfo(logits.dtype).min, logits)


_mask = jax.jit(_fill)
_mask_donated = jax.jit(_fill, donate_argnums=0)


@jax.jit
def _logits_masked(hidden: jax.Array, weight: jax.Array, mask: jax.Array) -> jax.Array:
    logits = jnp.einsum("...d,vd->...v", hidden, weight)  # [..., V]
    return _fill(logits, mask)


def _check_logits(logits: jax.Array, mapping: ImageVocabularyMapping) -> None:
    if not isinstance(logits, jax.Array):
        raise TypeError(f"logits must be a jax.Array on a device, got {type(logits).__name__}")
    if logits.ndim not in (2, 3):
        raise ValueError(f"logits must be 2-D [T, V] or 3-D [B, T, V], got shape {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.shape[-1] <= mapping.max_image_id:
        raise ValueError(
            f"logits vocab {logits.shape[-1]} does not cover the largest image token id "
            f"{mapping.max_image_id}"
        )


@jaxsync.check.entry_point
def mask_image_logits(
    logits: Float[Array, "*B T V"], mapping: ImageVocabularyMapping, *, donate: bool = False
) -> Float[Array, "*B T V"]:
    """Sets every image-token column of `logits` to `finfo(logits.dtype).min`.

    Args:
      logits: `[T, V]` or `[B, T, V]` device logits.
      mapping: the image vocabulary.
      donate: donate `logits` so the fill happens in place (the input is then deleted).

    Raises:
      TypeError / ValueError: host logits, wrong rank, non-float dtype, or `V` not above the
        largest image id (checked from shape metadata before dispatch).
    """
    _check_logits(logits, mapping)
    mask = mapping.image_token_mask_on(logits.shape[-1], replicated_near(logits))
    return (_mask_donated if donate else _mask)(logits, mask)


@jaxsync.check.entry_point
def compute_logits(
    hidden: Float[Array, "*B T D"],
    lm_head_weight: Float[Array, "V D"],
    mapping: ImageVocabularyMapping,
) -> Float[Array, "*B T V"]:
    """`hidden @ lm_head_weight.T` with the image tokens masked, in one jitted program.

    Args:
      hidden: `[T, D]` or `[B, T, D]` final hidden states.
      lm_head_weight: `[V, D]` (the torch `lm_head.weight` layout).
      mapping: the image vocabulary.
    """
    if hidden.ndim not in (2, 3):
        raise ValueError(f"hidden must be [T, D] or [B, T, D], got shape {hidden.shape}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, {hidden.shape[-1]}], got shape {lm_head_weight.shape}"
        )
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"dtype mismatch: hidden {hidden.dtype}, lm_head {lm_head_weight.dtype}")
    if lm_head_weight.shape[0] <= mapping.max_image_id:
        raise ValueError(
            f"lm_head vocab {lm_head_weight.shape[0]} does not cover the largest image token id "
            f"{mapping.max_image_id}"
        )
    mask = mapping.image_token_mask_on(lm_head_weight.shape[0], replicated_near(hidden))
    return _logits_masked(hidden, lm_head_weight, mask)
