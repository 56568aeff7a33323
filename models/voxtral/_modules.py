"""Voxtral audio encoder (a Whisper encoder) and multimodal projector as NNX modules.

Attribute names mirror transformers' `VoxtralEncoder` / `VoxtralMultiModalProjector`, so the weight
table in `_weights.py` is a plain rename plus layout transforms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.models._attention import AttentionImpl, resolve_attention
from jaxsync.models.voxtral._config import VoxtralAudioConfig


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # transformers "gelu" is the erf form


class Attention(nnx.Module):
    """Bidirectional multi-head self-attention (k_proj has no bias, as in Whisper)."""

    def __init__(
        self,
        cfg: VoxtralAudioConfig,
        *,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
        attention: AttentionImpl = "auto",
    ):
        d = cfg.hidden_size
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        # cuDNN flash attention on GPU for 16-bit weights: a 1500-frame window's [N, T, T] scores
        # never reach HBM (the XLA form made the encoder 0.65x transformers eager on an H200).
        self.impl = resolve_attention(attention, dtype, cfg.head_dim)
        self.q_proj = nnx.Linear(d, d, use_bias=True, **kw)
        self.k_proj = nnx.Linear(d, d, use_bias=False, **kw)
        self.v_proj = nnx.Linear(d, d, use_bias=True, **kw)
        self.out_proj = nnx.Linear(d, d, use_bias=True, **kw)
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim

    def __call__(self, x: jax.Array) -> jax.Array:  # [C, T, D] -> [C, T, D]
        c, t, _ = x.shape
        shape = (c, t, self.num_heads, self.head_dim)
        # Scale q before the product, as upstream does (it matters for low-precision rounding).
        q = (self.q_proj(x) * self.head_dim**-0.5).reshape(shape)  # [C, T, N, H]
        k = self.k_proj(x).reshape(shape)
        v = self.v_proj(x).reshape(shape)
        out = jax.nn.dot_product_attention(q, k, v, scale=1.0, implementation=self.impl)
        return self.out_proj(out.reshape(c, t, -1))


class EncoderLayer(nnx.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: VoxtralAudioConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, **kw)
        self.self_attn_layer_norm = nnx.LayerNorm(d, epsilon=eps, **kw)
        self.fc1 = nnx.Linear(d, cfg.intermediate_size, **kw)
        self.fc2 = nnx.Linear(cfg.intermediate_size, d, **kw)
        self.final_layer_norm = nnx.LayerNorm(d, epsilon=eps, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:  # [C, T, D]
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(_gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nnx.Module):
    """Conv1d (k3) + GELU, Conv1d (k3, stride 2) + GELU, positions, layers, final LayerNorm."""

    def __init__(self, cfg: VoxtralAudioConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d = cfg.hidden_size
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.conv1 = nnx.Conv(cfg.num_mel_bins, d, kernel_size=(3,), padding=((1, 1),), **kw)
        self.conv2 = nnx.Conv(d, d, kernel_size=(3,), strides=(2,), padding=((1, 1),), **kw)
        # transformers keeps embed_positions in float32 whatever the model dtype.
        self.embed_positions = nnx.Embed(
            cfg.max_source_positions, d, rngs=rngs, dtype=jnp.float32, param_dtype=jnp.float32
        )
        self.layers = nnx.List([EncoderLayer(cfg, **kw) for _ in range(cfg.num_hidden_layers)])
        self.layer_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, **kw)
        self.chunk_frames = cfg.chunk_frames
        self.dtype = dtype

    def __call__(self, mel: jax.Array) -> jax.Array:  # [C, F, 2P] -> [C, P, D]
        if mel.shape[-1] != self.chunk_frames:
            raise ValueError(
                f"encoder windows must have {self.chunk_frames} frames, got {mel.shape}"
            )
        h = jnp.swapaxes(mel.astype(self.dtype), 1, 2)  # [C, 2P, F]
        h = _gelu(self.conv1(h))
        h = _gelu(self.conv2(h))  # [C, P, D]
        pos = self.embed_positions.embedding[...]  # [P, D] float32
        h = (h.astype(jnp.float32) + pos[None]).astype(h.dtype)
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)


class Projector(nnx.Module):
    """`linear_2(gelu(linear_1(x)))` on groups of `frames_per_token` encoder frames (no biases)."""

    def __init__(self, cfg: VoxtralAudioConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        h = cfg.text_hidden_size
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.linear_1 = nnx.Linear(cfg.intermediate_size, h, **kw)
        self.linear_2 = nnx.Linear(h, h, **kw)
        self.group = cfg.frames_per_token

    def __call__(self, h: jax.Array) -> jax.Array:  # [C, P, D] -> [C, P / group, V_hidden]
        c, p, d = h.shape
        h = h.reshape(c, p // self.group, self.group * d)  # consecutive frames of one window
        return self.linear_2(_gelu(self.linear_1(h)))
