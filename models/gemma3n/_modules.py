"""Gemma 3n audio path as NNX modules, and its pure forward.

`Gemma3nAudioTower` is transformers' `Gemma3nAudioEncoder` (SSCP, conformer, reduction),
`Gemma3nMultimodalEmbedder` its `Gemma3nMultimodalEmbedder`, and `Gemma3nAudioModel` holds both
under the checkpoint names (`audio_tower.*`, `embed_audio.*`). `forward` is the audio part of
`Gemma3nModel.forward`: features -> `soft_tokens` embeddings per clip, the padding token's
embedding filling padded and missing positions.
"""

from typing import Any

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
    "forward",
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
        self.time_stride = cfg.time_stride
        self.reduction = cfg.conf_reduction_factor
        self.dtype = dtype
        self.subsample_conv_projection = SubSampleConvProjection(cfg, **kw)
        self.conformer = nnx.List(
            [ConformerBlock(cfg, **kw) for _ in range(cfg.conf_num_hidden_layers)]
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
        x = jaxsync.run_layers(self.conformer, x, ~padding)
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
    `model.embed_audio.*`); `layers` names the conformer blocks for `jaxsync.TowerProgram`.
    """

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.pad_id = cfg.text_vocab_size - 1
        self.soft_tokens = cfg.soft_tokens
        self.dtype = dtype
        self.audio_tower = Gemma3nAudioTower(cfg, **kw)
        self.embed_audio = Gemma3nMultimodalEmbedder(cfg, **kw)

    @property
    def layers(self) -> nnx.List:
        """The conformer blocks (`audio_tower.conformer`): the layer list a program scans."""
        return self.audio_tower.conformer

    @layers.setter
    def layers(self, value: nnx.List) -> None:
        self.audio_tower.conformer = value

    def pad_embedding(self) -> jax.Array:
        """The padding token `text_vocab_size - 1` through the hard path: `[D]`, model dtype."""
        ids = jnp.full((1,), self.pad_id, jnp.int32)
        return self.embed_audio.embed_ids(ids)[0].astype(self.dtype)


def forward(
    model: Gemma3nAudioModel, features: jax.Array, meta: Any, pad_embedding: Any = None
) -> tuple[jax.Array, jax.Array]:
    """Features -> `soft_tokens` embeddings per clip (the audio part of `Gemma3nModel.forward`).

    Pure: callable inside any jit (weights arrive with `model`, e.g. `nnx.merge(graphdef,
    state)`); the conformer runs through `jaxsync.run_layers`.

    Args:
        model: the loaded `Gemma3nAudioModel`.
        features: `[B, T, F]` log-mel features (any float dtype).
        meta: `plan.fields` as uploaded (`jaxsync.Packed` or a dict): `valid` `[B, T]` bool
            (True = real frame) and `frames` `[1]` int32 (the frame count upstream saw when `T`
            is a bucket).
        pad_embedding: `[D]` embedding of the padding token (`model.pad_embedding()`, cached by
            the entry); None computes it here.

    Returns:
        rows `[B * soft_tokens, D]` (clip `i` owns rows `i*N : (i+1)*N`: tower positions first,
        padding positions and the tail up to `soft_tokens` take the padding embedding, positions
        past `soft_tokens` are dropped) and finite `[B]` bool (the clip's features and rows
        are all finite).
    """
    pad = model.pad_embedding() if pad_embedding is None else pad_embedding
    tower = model.audio_tower
    x, padding = tower.subsample(features, ~meta["valid"], meta["frames"][0])
    x = jaxsync.run_layers(tower.conformer, x, ~padding)
    enc, padding = tower.reduce(x, padding)  # [B, T_a, D_a], [B, T_a]
    emb = model.embed_audio.embed_soft(enc).astype(model.dtype)  # [B, T_a, D]
    b, t_a, d = emb.shape
    n = model.soft_tokens
    fill = jnp.broadcast_to(pad.astype(emb.dtype), (b, max(n, t_a), d))
    emb = jnp.where(padding[:, :, None], fill[:, :t_a], emb)
    emb = emb[:, :n] if t_a >= n else jnp.concatenate([emb, fill[:, : n - t_a]], axis=1)
    finite = jnp.isfinite(features).all(axis=(1, 2)) & jnp.isfinite(emb).all(axis=(1, 2))
    return emb.reshape(b * n, d), finite
