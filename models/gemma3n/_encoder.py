"""Gemma 3n audio tower (transformers `Gemma3nAudioEncoder`) and audio embedder."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.models.gemma3n._attention import ConformerAttention
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._modules import (
    ConformerFeedForward,
    ConformerLightConv1d,
    RMSNorm,
    SubSampleConvProjection,
    _linear,
    clip,
)


__all__ = ["ConformerBlock", "AudioEncoder", "MultimodalEmbedder"]


class ConformerBlock(nnx.Module):
    """Feed-forward half, attention, light conv (on masked input), feed-forward half, norm."""

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.bound = cfg.gradient_clipping
        self.ffw_layer_start = ConformerFeedForward(cfg, **kw)
        self.attention = ConformerAttention(cfg, **kw)
        self.lconv1d = ConformerLightConv1d(cfg, **kw)
        self.ffw_layer_end = ConformerFeedForward(cfg, **kw)
        self.norm = RMSNorm(cfg.hidden_size, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, valid: jax.Array) -> jax.Array:
        x = self.attention(self.ffw_layer_start(x), valid)
        # Padded frames are zeroed before the causal conv so they cannot leak into later frames.
        x = self.lconv1d(x * valid[:, :, None].astype(x.dtype))
        return self.norm(clip(self.ffw_layer_end(x), self.bound))


class AudioEncoder(nnx.Module):
    """Mel features `[B, T, F]` -> conformer encodings `[B, T_a, D_a]` and padding mask `[B, T_a]`.

    Mirrors `Gemma3nAudioEncoder.forward`: SSCP (÷4 in time), the frame mask subsampled by
    gathering every `time_stride`-th entry, the conformer stack, the `[::R]` reduction, padded
    positions zeroed. `padding` is True where a frame is padding (upstream's convention).
    """

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.time_stride = cfg.time_stride
        self.reduction = cfg.conf_reduction_factor
        self.dtype = dtype
        self.subsample_conv_projection = SubSampleConvProjection(cfg, **kw)
        self.conformer = nnx.List(
            [ConformerBlock(cfg, **kw) for _ in range(cfg.conf_num_hidden_layers)]
        )

    def __call__(
        self, features: jax.Array, padding: jax.Array, frames: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Args: features `[B, T, F]`; padding `[B, T]` bool (True = padding); frames: optional
        int32 scalar, the unbucketed frame count when `T` is a bucket (see SubSampleConvProjection).
        Returns encodings `[B, T_a, D_a]` (zero at padding) and padding `[B, T_a]`.
        """
        x = self.subsample_conv_projection(features.astype(self.dtype), frames)  # [B, T', D]
        t_in, t_sub = padding.shape[1], x.shape[1]
        idx = jnp.minimum(jnp.arange(t_sub) * self.time_stride, t_in - 1)
        padding = padding[:, idx]  # [B, T']
        valid = ~padding
        for block in self.conformer:
            x = block(x, valid)
        x, padding = x[:, :: self.reduction], padding[:, :: self.reduction]
        x = jnp.where(padding[:, :, None], jnp.zeros((), x.dtype), x)
        return x, padding  # [B, T_a, D], [B, T_a]


class MultimodalEmbedder(nnx.Module):
    """Audio tokens -> text space (`Gemma3nMultimodalEmbedder`).

    Soft path: RMSNorm(w) -> Linear(D_a -> D) -> RMSNorm(no w). Hard path: the same after an
    embedding lookup of `id - vocab_offset` with its own pre-norm.
    """

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        d_a, d, eps = cfg.hidden_size, cfg.text_hidden_size, cfg.rms_norm_eps
        self.vocab_offset = cfg.audio_vocab_offset
        self.embedding = nnx.Embed(
            cfg.audio_vocab_size, d_a, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.hard_embedding_norm = RMSNorm(d_a, eps=eps, param_dtype=param_dtype)
        self.soft_embedding_norm = RMSNorm(d_a, eps=eps, param_dtype=param_dtype)
        self.embedding_projection = _linear(d_a, d, dtype, param_dtype, rngs)
        self.embedding_post_projection_norm = RMSNorm(d, eps=eps, with_scale=False)

    def embed_soft(self, x: jax.Array) -> jax.Array:
        """`[..., D_a]` tower outputs -> `[..., D]`."""
        return self.embedding_post_projection_norm(
            self.embedding_projection(self.soft_embedding_norm(x))
        )

    def embed_ids(self, ids: jax.Array) -> jax.Array:
        """`[...]` audio-vocabulary token ids -> `[..., D]`."""
        h = self.hard_embedding_norm(self.embedding(ids - self.vocab_offset))
        return self.embedding_post_projection_norm(self.embedding_projection(h))
