"""Layers of the GLM-4.1V vision tower (transformers `Glm4vVision*`), as flax.nnx modules.

All layers run in the parameter dtype like upstream; RMSNorm statistics, rotary and softmax are
computed in float32 exactly where upstream upcasts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.models._attention import AttentionImpl, resolve_attention
from jaxsync.models.glm4v._config import Glm4vVisionConfig


_ACT = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class RMSNorm(nnx.Module):
    """`Glm4vRMSNorm`: normalise in float32, cast back, then scale in the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)  # [P, D]
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        return self.weight[None, :] * (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)


def _linear(n_in: int, n_out: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class GatedMlp(nnx.Module):
    """down(act(gate(x)) * up(x)), no biases (the block MLP and the merger's tail)."""

    def __init__(self, dim: int, hidden: int, act: str, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.act = act
        self.gate_proj = _linear(dim, hidden, False, dtype, rngs)
        self.up_proj = _linear(dim, hidden, False, dtype, rngs)
        self.down_proj = _linear(hidden, dim, False, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(_ACT[self.act](self.gate_proj(x)) * self.up_proj(x))


def rotary_cos_sin(
    h: jax.Array, w: jax.Array, head_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """Axial 2-D rotary tables: [P] row/col coordinates -> cos, sin of shape [P, H].

    A quarter of the head rotates with the row, a quarter with the column, and the halves repeat
    (rotate_half pairs dim i with i + H/2), as `Glm4vVisionRotaryEmbedding`.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))  # [H/4]
    fh = h.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [P, H/4]
    fw = w.astype(jnp.float32)[:, None] * inv_freq[None, :]
    freqs = jnp.concatenate([fh, fw, fh, fw], axis=-1)  # [P, H]
    return jnp.cos(freqs), jnp.sin(freqs)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin in float32; x: [P, N, H], cos/sin: [P, H]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


class Attention(nnx.Module):
    """`Glm4vVisionAttention` over a packed sequence, restricted to each segment (frame)."""

    def __init__(
        self,
        cfg: Glm4vVisionConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        impl: AttentionImpl = "auto",
    ):
        d = cfg.hidden_size
        self.impl = resolve_attention(impl, dtype, cfg.head_dim)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = _linear(d, 3 * d, cfg.attention_bias, dtype, rngs)
        self.proj = _linear(d, d, False, dtype, rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, same_segment: jax.Array
    ) -> jax.Array:
        p = x.shape[0]
        qkv = self.qkv(x).reshape(p, 3, self.num_heads, self.head_dim)  # [P, 3, N, H]
        q = _rotate(qkv[:, 0], cos, sin)  # [P, N, H]
        k = _rotate(qkv[:, 1], cos, sin)
        v = qkv[:, 2]
        if self.impl == "cudnn":
            out = jax.nn.dot_product_attention(
                q[None], k[None], v[None], mask=same_segment[None, None], implementation="cudnn"
            )[0]
            return self.proj(out.reshape(p, self.num_heads * self.head_dim))
        scores = jnp.einsum("QNH,KNH->NQK", q, k, preferred_element_type=jnp.float32)
        scores = scores * (self.head_dim**-0.5)
        # Every row keeps at least its own key (padding forms its own segment): no all-masked row.
        scores = jnp.where(same_segment[None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [N, Q, K]
        out = jnp.einsum("NQK,KNH->QNH", probs, v)
        return self.proj(out.reshape(p, self.num_heads * self.head_dim))


class Block(nnx.Module):
    """`Glm4vVisionBlock`: pre-norm attention and MLP with residuals."""

    def __init__(
        self,
        cfg: Glm4vVisionConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        attention: AttentionImpl = "auto",
    ):
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, impl=attention)
        # Upstream quirk kept: the block MLP is out_hidden_size wide, not intermediate_size.
        self.mlp = GatedMlp(
            cfg.hidden_size, cfg.out_hidden_size, cfg.hidden_act, dtype=dtype, rngs=rngs
        )

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, same_segment: jax.Array
    ) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, same_segment)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """`Glm4vVisionPatchMerger`: proj -> LayerNorm -> exact GELU -> gated MLP."""

    def __init__(self, cfg: Glm4vVisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        dim = cfg.out_hidden_size
        self.proj = _linear(dim, dim, False, dtype, rngs)
        # torch LayerNorm defaults: eps 1e-5, two-pass variance.
        self.post_projection_norm = nnx.LayerNorm(
            dim, epsilon=1e-5, use_fast_variance=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.mlp = GatedMlp(dim, cfg.intermediate_size, cfg.hidden_act, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.gelu(self.post_projection_norm(self.proj(x)), approximate=False)
        return self.mlp(x)
