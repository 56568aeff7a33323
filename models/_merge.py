# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Writing media embeddings into a prompt's text embeddings at host-planned positions.

transformers merges with `masked_scatter(input_ids == token_id, media)`, whose mask needs its
population count (a device read, or a data-dependent shape). Here the placeholder positions are
host metadata, found on the host, padded to a bucket with an out-of-range index and uploaded
once; the merge is one `.at[positions].set(..., mode="drop")`, shared by every family.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def scatter_rows(
    text_embeds: Float[Array, "*B S D"],
    rows: Float[Array, "*N T D"],
    positions: Int[Array, " P"],
) -> Float[Array, "*B S D"]:
    """Writes `rows`, in order, at flat row-major `positions` of `text_embeds` (pure, any jit).

    Args:
      text_embeds: `[S, D]` or `[B, S, D]`.
      rows: `[N, T, D]` or `[M, D]`; rows past the real count may be padding.
      positions: int32 `[P]`; slots `>= B*S` are dropped (bucket padding), so P may exceed the
        real count, and row `i` goes to `positions[i]`.
    """
    flat = text_embeds.reshape(-1, text_embeds.shape[-1])  # [B*S, D]
    src = rows.reshape(-1, rows.shape[-1])  # [M, D]
    # Padded slots point past the end of `flat` and are dropped; their source row is irrelevant.
    take = jnp.minimum(jnp.arange(positions.shape[0]), src.shape[0] - 1)  # [P]
    merged = flat.at[positions].set(src[take].astype(flat.dtype), mode="drop")
    return merged.reshape(text_embeds.shape)


scatter_rows_jit = jax.jit(scatter_rows)
