"""The prompt merge of the Gemma 3n audio path: audio rows into the placeholder positions."""

from typing import Any

import jax
import numpy as np

import jaxsync
from jaxsync._host import host_int, host_ints
from jaxsync.check import entry_point
from jaxsync.models._merge import scatter_rows


__all__ = ["merge_audio_embeddings"]


@jax.jit
def _scatter(text: jax.Array, rows: jax.Array, up: jaxsync.Packed) -> jax.Array:
    return scatter_rows(text, rows, up.positions)


@entry_point
def merge_audio_embeddings(
    text_embeds: jax.Array, audio: jaxsync.Embeddings, input_ids: Any, *, audio_token_id: int
) -> jax.Array:
    """Writes audio embeddings into the text embeddings at the audio placeholder tokens.

    Same result as transformers' `masked_scatter(input_ids == audio_token_id, audio_features)`;
    the placeholder positions come from the host token ids, so nothing is read back.

    Args:
        text_embeds: `[..., T, D]` device embeddings of the prompt.
        audio: the encoder's `Embeddings` (its `num_tokens` rows fill the placeholders in order).
        input_ids: host token ids with the shape of `text_embeds[..., 0]`.
        audio_token_id: the placeholder id (`cfg.audio_token_id`).

    Raises:
        TypeError: non-integer ids or placeholder id.
        ValueError: shape mismatch, or placeholder count != `audio.num_tokens` (as transformers).
    """
    ids = host_ints(input_ids, name="input_ids", ndim=None, minimum=None)
    token = host_int(audio_token_id, name="audio_token_id")
    if ids.shape != tuple(text_embeds.shape[:-1]):
        raise ValueError(
            f"input_ids shape {ids.shape} != text_embeds shape[:-1] {tuple(text_embeds.shape[:-1])}"
        )
    rows = audio.embeddings
    if rows.ndim != 2 or rows.shape[1] != text_embeds.shape[-1]:
        raise ValueError(f"audio rows {rows.shape} do not fit text_embeds {text_embeds.shape}")
    pos = np.flatnonzero(ids.reshape(-1) == token)
    if pos.size != audio.num_tokens:
        raise ValueError(
            f"{pos.size} audio placeholder tokens but {audio.num_tokens} audio embeddings"
        )
    slots = np.full(rows.shape[0], ids.size, np.int32)
    slots[: pos.size] = pos
    up = jaxsync.upload_packed({"positions": slots}, placement=jaxsync.replicated_near(text_embeds))
    return _scatter(text_embeds, rows, up)
