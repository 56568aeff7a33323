"""Gemma 3n audio path as NNX modules.

`Gemma3nAudioTower` is transformers' `Gemma3nAudioEncoder` (SSCP, conformer, reduction),
`Gemma3nMultimodalEmbedder` its `Gemma3nMultimodalEmbedder`, and `Gemma3nAudioModel` holds both
under the checkpoint names (`audio_tower.*`, `embed_audio.*`). The pure forwards over them are in
`_forward.py`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync.models.gemma3n._attention import ConformerAttention
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._conformer import (
    ConformerFeedForward,
    ConformerLightConv1d,
    RMSNorm,
    SubSampleConvProjection,
    clip,
    linear,
)


__all__ = [
    "ConformerBlock",
    "Gemma3nAudioModel",
    "Gemma3nAudioTower",
    "Gemma3nMultimodalEmbedder",
]


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
        """x `[B, T, D]`, valid `[B, T]` bool (True = real frame) -> `[B, T, D]`."""
        x = self.attention(self.ffw_layer_start(x), valid)
        # Padded frames are zeroed before the causal conv so they cannot leak into later frames
        # (`where`, not a multiply: a non-finite padded frame must not turn into 0 * inf = NaN).
        x = self.lconv1d(jnp.where(valid[:, :, None], x, jnp.zeros((), x.dtype)))
        return self.norm(clip(self.ffw_layer_end(x), self.bound))


class Gemma3nAudioTower(nnx.Module):
    """Mel features `[B, T, F]` -> conformer encodings `[B, T_a, D_a]` and padding `[B, T_a]`.

    Mirrors `Gemma3nAudioEncoder.forward`: SSCP (÷4 in time), the frame mask subsampled by
    gathering every `time_stride`-th entry, the conformer stack, the `[::R]` reduction, padded
    positions zeroed. `padding` is True where a frame is padding (upstream's convention).
    """

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.cfg = cfg
        self.time_stride = cfg.time_stride
        self.reduction = cfg.conf_reduction_factor
        self.dtype = dtype
        self.subsample_conv_projection = SubSampleConvProjection(cfg, **kw)
        self.conformer = jaxsync.LayerStack(
            lambda r: ConformerBlock(cfg, rngs=r, dtype=dtype, param_dtype=param_dtype),
            cfg.conf_num_hidden_layers,
            rngs=rngs,
        )

    def subsample(
        self, features: jax.Array, padding: jax.Array, frames: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """SSCP: features `[B, T, F]` -> `[B, T', D_a]` and padding `[B, T']`."""
        x = self.subsample_conv_projection(features.astype(self.dtype), frames)  # [B, T', D]
        t_in, t_sub = padding.shape[1], x.shape[1]
        idx = jnp.minimum(jnp.arange(t_sub) * self.time_stride, t_in - 1)
        return x, padding[:, idx]

    def reduce(self, x: jax.Array, padding: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The `[::R]` reduction, padded positions zeroed: `[B, T_a, D_a]`, `[B, T_a]`."""
        x, padding = x[:, :: self.reduction], padding[:, :: self.reduction]
        return jnp.where(padding[:, :, None], jnp.zeros((), x.dtype), x), padding

    def __call__(
        self, features: jax.Array, padding: jax.Array, frames: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Args: features `[B, T, F]`; padding `[B, T]` bool (True = padding); frames: optional
        int32 scalar, the unbucketed frame count when `T` is a bucket (see SubSampleConvProjection).
        Returns encodings `[B, T_a, D_a]` (zero at padding) and padding `[B, T_a]`.
        """
        x, padding = self.subsample(features, padding, frames)
        x = self.conformer(x, ~padding)  # one scan over the stacked blocks
        return self.reduce(x, padding)


class Gemma3nMultimodalEmbedder(nnx.Module):
    """Audio tokens -> text space (transformers `Gemma3nMultimodalEmbedder`).

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
        self.embedding_projection = linear(d_a, d, dtype, param_dtype, rngs)
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


class Gemma3nAudioModel(nnx.Module):
    """The audio tower and audio embedder of `Gemma3nModel` (checkpoint `model.audio_tower.*`,
    `model.embed_audio.*`).

    Attributes:
        cfg: the `Gemma3nAudioConfig` it was built from (the tower holds the same `cfg`).
        audio_tower: the `Gemma3nAudioTower`; its conformer blocks are one `jaxsync.LayerStack`
            (`audio_tower.conformer`, layer i: `audio_tower.conformer.at(i)`).
        embed_audio: the `Gemma3nMultimodalEmbedder`.
    """

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.cfg = cfg
        self.pad_id = cfg.text_vocab_size - 1
        self.soft_tokens = cfg.soft_tokens
        self.dtype = dtype
        self.audio_tower = Gemma3nAudioTower(cfg, **kw)
        self.embed_audio = Gemma3nMultimodalEmbedder(cfg, **kw)

    def pad_embedding(self) -> jax.Array:
        """The padding token `text_vocab_size - 1` through the hard path: `[D]`, model dtype."""
        ids = jnp.full((1,), self.pad_id, jnp.int32)
        return self.embed_audio.embed_ids(ids)[0].astype(self.dtype)
