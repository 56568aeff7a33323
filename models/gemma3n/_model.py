"""Gemma 3n audio path: features -> tower -> embedder -> fixed-length padding, in one jitted call.

Upstream (transformers `Gemma3nModel.forward`, vLLM `_process_audio_input`) embeds the padding
token `text_vocab_size - 1` through the audio hard path on every call; here its embedding is
computed once per weights and placement and cached on the device (`AudioEmbedder.pad_embedding`).
"""

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._encoder import AudioEncoder, MultimodalEmbedder


__all__ = ["Gemma3nAudioModel"]


class Gemma3nAudioModel(nnx.Module):
    """The audio tower and audio embedder of `Gemma3nModel` (checkpoint `model.audio_tower.*`,
    `model.embed_audio.*`), with upstream's padding to `soft_tokens` positions per clip.
    """

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        self.pad_id = cfg.text_vocab_size - 1
        self.soft_tokens = cfg.soft_tokens
        self.dtype = dtype
        self.audio_tower = AudioEncoder(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_audio = MultimodalEmbedder(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def pad_embedding(self) -> jax.Array:
        """The padding token through the hard path: `[D]` in the model dtype."""
        ids = jnp.full((1,), self.pad_id, jnp.int32)
        return self.embed_audio.embed_ids(ids)[0].astype(self.dtype)

    def embed(
        self,
        features: jax.Array,
        padding: jax.Array,
        pad_emb: jax.Array,
        frames: jax.Array | None = None,
    ) -> jax.Array:
        """Features to `soft_tokens` embeddings per clip (HF `Gemma3nModel.forward`'s audio part).

        Args:
            features: `[B, T, F]` log-mel features.
            padding: `[B, T]` bool, True = padding frame (the tower's convention).
            pad_emb: `[D]` embedding of the padding token (`pad_embedding()`).
            frames: optional int32 scalar: frames upstream saw when `T` is a bucket.

        Returns:
            `[B, soft_tokens, D]`: tower positions first (padding positions take `pad_emb`), then
            `pad_emb` up to `soft_tokens`; positions past `soft_tokens` are dropped (the host
            decides beforehand whether that is an error, see `AudioEmbedder`).
        """
        enc, pad = self.audio_tower(features, padding, frames)  # [B, T_a, D_a], [B, T_a]
        emb = self.embed_audio.embed_soft(enc).astype(self.dtype)  # [B, T_a, D]
        b, t_a, d = emb.shape
        fill = jnp.broadcast_to(pad_emb.astype(emb.dtype)[None, None, :], (b, t_a, d))
        emb = jnp.where(pad[:, :, None], fill, emb)
        n = self.soft_tokens
        if t_a >= n:
            return emb[:, :n]
        tail = jnp.broadcast_to(pad_emb.astype(emb.dtype)[None, None, :], (b, n - t_a, d))
        return jnp.concatenate([emb, tail], axis=1)

    def embed_packed(self, up: jaxsync.Packed, pad_emb: jax.Array) -> jax.Array:
        """`embed` on one packed upload holding `features`, `valid` and `frames`."""
        return self.embed(up["features"], ~up["valid"], pad_emb, up["frames"][0])
