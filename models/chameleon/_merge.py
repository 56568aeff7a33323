# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Scatter image-token embeddings into the text embeddings at the `<image>` placeholders.

HF uses `masked_scatter` with a boolean mask (`input_ids == image_token_id`), which needs the
mask's population count, i.e. a device read (or a data-dependent shape). Here the placeholder
positions are host metadata (the prompt's token ids are on the host anyway): `plan_merge` finds
and checks them on the host and pads them to a bucket with an out-of-range index, and the merge
is one `.at[positions].set(..., mode="drop")`.

`merge_image_tokens(text_embeds, image_embeds, positions)` is that scatter as a pure function: a
server calls it inside its own jitted step or `shard_map` with the uploaded
`plan_merge(...).meta.positions`; it adds no jit argument and no host callback.
`ChameleonImageEncoder.merge_image_embeddings` is the standalone entry point (host checks, one
upload, one jitted call).
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

from jaxsync.models._merge import scatter_rows
from jaxsync.models.chameleon._vocab import check_device_array


def merge_image_tokens(
    text_embeds: Float[Array, "*B S D"],
    image_embeds: Float[Array, "*N T D"],
    positions: Int[Array, " P"],
) -> Float[Array, "*B S D"]:
    """Writes image rows, in order, at flat row-major `positions` of `text_embeds` (pure).

    Args:
      text_embeds: `[S, D]` or `[B, S, D]`.
      image_embeds: `[N, T, D]` or `[M, D]`; rows past the real count may be padding.
      positions: int32 `[P]` from `plan_merge`; slots `>= B*S` are dropped (bucket padding).
    """
    return scatter_rows(text_embeds, image_embeds, positions)


merge_jit = jax.jit(merge_image_tokens)
merge_jit_donated = jax.jit(merge_image_tokens, donate_argnums=0)


def check_embeds(text_embeds, image_embeds, input_ids, positions) -> None:
    """Host checks of a merge's device embeddings and host metadata (no sync)."""
    check_device_array(text_embeds, "text_embeds")
    check_device_array(image_embeds, "image_embeds")
    if text_embeds.ndim not in (2, 3) or image_embeds.ndim not in (2, 3):
        raise ValueError(
            f"text_embeds must be [S, D] or [B, S, D] and image_embeds [N, T, D] or [M, D]; "
            f"got {text_embeds.shape} and {image_embeds.shape}"
        )
    if text_embeds.shape[-1] != image_embeds.shape[-1]:
        raise ValueError(f"embedding sizes differ: {text_embeds.shape} vs {image_embeds.shape}")
    for name, host in (("input_ids", input_ids), ("positions", positions)):
        if isinstance(host, jax.Array):
            raise TypeError(f"{name} must be host data (numpy); reading a jax.Array would sync")
