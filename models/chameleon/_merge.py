# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Scatter image-token embeddings into the text embeddings at the `<image>` placeholders.

HF uses `masked_scatter` with a boolean mask (`input_ids == image_token_id`), which needs the
mask's population count, i.e. a device read (or a data-dependent shape). Here the placeholder
positions are host metadata (the prompt's token ids are on the host anyway): they are found and
checked on the host, padded to a bucket with an out-of-range index, uploaded once, and the merge
is one `.at[positions].set(..., mode="drop")` inside jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

import jaxsync
import jaxsync.check
from jaxsync import replicated_near


def _scatter(text: jax.Array, image: jax.Array, positions: jax.Array) -> jax.Array:
    flat = text.reshape(-1, text.shape[-1])  # [B*S, D]
    rows = image.reshape(-1, image.shape[-1])  # [M, D]
    # Padded slots point past the end of `flat` and are dropped; their source row is irrelevant.
    src = jnp.minimum(jnp.arange(positions.shape[0]), rows.shape[0] - 1)  # [P]
    merged = flat.at[positions].set(rows[src].astype(flat.dtype), mode="drop")
    return merged.reshape(text.shape)


_merge = jax.jit(_scatter)
_merge_donated = jax.jit(_scatter, donate_argnums=0)


def placeholder_positions(input_ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """Flat (row-major) indices of the `<image>` placeholders in host `input_ids`."""
    return np.flatnonzero(np.asarray(input_ids).reshape(-1) == image_token_id).astype(np.int32)


@jaxsync.check.entry_point
def merge_image_embeddings(
    text_embeds: Float[Array, "*B S D"],
    image_embeds: Float[Array, "*N T D"],
    *,
    input_ids: np.ndarray | None = None,
    image_token_id: int | None = None,
    positions: np.ndarray | None = None,
    num_image_tokens: int | None = None,
    donate: bool = False,
) -> Float[Array, "*B S D"]:
    """Writes image-token embeddings, in order, at the placeholder positions.

    Args:
      text_embeds: `[S, D]` or `[B, S, D]` device embeddings of the prompt.
      image_embeds: `[N, T, D]` or `[M, D]` device image-token embeddings (may be bucket padded).
      input_ids: host token ids shaped like `text_embeds.shape[:-1]` (with `image_token_id`).
      image_token_id: the `<image>` placeholder id (with `input_ids`).
      positions: instead of `input_ids`: host flat row-major indices of the placeholders.
      num_image_tokens: how many leading rows of `image_embeds` are real (default: all).
      donate: donate `text_embeds` so the merge happens in place.

    Raises:
      ValueError: the placeholder count differs from `num_image_tokens`, positions are out of
        range or repeated, or shapes disagree (all checked on the host before dispatch).
    """
    if text_embeds.ndim not in (2, 3) or image_embeds.ndim not in (2, 3):
        raise ValueError(
            f"text_embeds must be [S, D] or [B, S, D] and image_embeds [N, T, D] or [M, D]; got "
            f"{text_embeds.shape} and {image_embeds.shape}"
        )
    if text_embeds.shape[-1] != image_embeds.shape[-1]:
        raise ValueError(f"embedding sizes differ: {text_embeds.shape} vs {image_embeds.shape}")
    if (positions is None) == (input_ids is None):
        raise ValueError("pass exactly one of input_ids (with image_token_id) or positions")
    for name, host in (("input_ids", input_ids), ("positions", positions)):
        if isinstance(host, jax.Array):
            raise TypeError(f"{name} must be host data (numpy); reading a jax.Array would sync")
    total = int(np.prod(text_embeds.shape[:-1]))
    if input_ids is not None:
        if image_token_id is None:
            raise ValueError("input_ids needs image_token_id")
        if tuple(np.shape(input_ids)) != tuple(text_embeds.shape[:-1]):
            raise ValueError(f"input_ids shape {np.shape(input_ids)} != {text_embeds.shape[:-1]}")
        positions = placeholder_positions(input_ids, image_token_id)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    rows = int(np.prod(image_embeds.shape[:-1]))
    n = rows if num_image_tokens is None else int(num_image_tokens)
    if not 0 <= n <= rows:
        raise ValueError(f"num_image_tokens={n} but image_embeds holds {rows} rows")
    if positions.size != n:
        raise ValueError(
            f"image placeholders and image tokens do not match: {positions.size} placeholder "
            f"position(s) but {n} image token embedding(s)"
        )
    if n and (positions.min() < 0 or positions.max() >= total):
        raise ValueError(f"placeholder positions must lie in [0, {total})")
    if np.unique(positions).size != n:
        raise ValueError("placeholder positions repeat")
    if n == 0:
        return text_embeds
    padded = np.full((jaxsync.bucket(n),), total, dtype=np.int32)  # out of range -> dropped
    padded[:n] = positions
    pos = jaxsync.async_h2d(padded, placement=replicated_near(text_embeds))
    return (_merge_donated if donate else _merge)(text_embeds, image_embeds, pos)
