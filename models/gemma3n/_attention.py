"""Chunked local self-attention of the Gemma 3n audio conformer.

The sequence is cut into query blocks of W frames; each block attends to a key context of
C = W + P + R frames (P = context_left - 1 frames back, R = context_right ahead). Logits are
content (q·k) plus a Transformer-XL style relative term (q·pos_proj(sinusoid)), soft-capped
by tanh, masked by key validity and the local window, softmaxed in float32.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._conformer import RMSNorm, clip, linear


__all__ = ["ChunkedLocalAttention", "ConformerAttention"]


def _timing_signal(positions: np.ndarray, channels: int) -> jax.Array:
    """Sinusoids `[len(positions), channels]`: sin half, then cos half (float32, as upstream)."""
    n = channels // 2
    increment = math.log(1.0e4) / max(n - 1, 1)
    inv = jnp.exp(jnp.arange(n, dtype=jnp.float32) * -increment)  # [D/2]
    scaled = jnp.asarray(positions, jnp.float32)[:, None] * inv[None, :]
    return jnp.concatenate([jnp.sin(scaled), jnp.cos(scaled)], axis=-1)


class RelativePositionEmbedding(nnx.Module):
    """Projects the sinusoid of relative positions to per-head keys (`pos_proj`, no bias)."""

    def __init__(self, d: int, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.channels = d
        self.pos_proj = linear(d, d, dtype, param_dtype, rngs)

    def __call__(self, positions: np.ndarray, dtype) -> jax.Array:
        return self.pos_proj(_timing_signal(positions, self.channels).astype(dtype))  # [F, D]


class ChunkedLocalAttention(nnx.Module):
    """Block-local attention with relative positions; returns `[B, T, N, H]`."""

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        d, self.num_heads, self.head_dim = (
            cfg.hidden_size,
            cfg.conf_num_attention_heads,
            cfg.head_dim,
        )
        self.chunk = cfg.conf_attention_chunk_size
        self.past = max(0, cfg.conf_attention_context_left - 1)
        self.future = cfg.conf_attention_context_right
        self.context = self.chunk + self.past + self.future
        self.cap = cfg.conf_attention_logit_cap
        self.q_proj = linear(d, d, dtype, param_dtype, rngs)
        self.k_proj = linear(d, d, dtype, param_dtype, rngs)
        self.v_proj = linear(d, d, dtype, param_dtype, rngs)
        self.per_dim_scale = nnx.Param(jnp.zeros((self.head_dim,), param_dtype))
        self.relative_position_embedding = RelativePositionEmbedding(
            d, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )

    def _blocks(self, x: jax.Array) -> jax.Array:
        """`[B, T, ...]` -> non-overlapping query blocks `[B, U, W, ...]` (zero padded)."""
        t = x.shape[1]
        u = -(-t // self.chunk)
        x = jnp.pad(x, ((0, 0), (0, u * self.chunk - t)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(x.shape[0], u, self.chunk, *x.shape[2:])

    def _context(self, x: jax.Array) -> jax.Array:
        """`[B, T, ...]` -> key context per block `[B, U, C, ...]`; outside frames are 0/False."""
        t = x.shape[1]
        u = -(-t // self.chunk)
        pad = ((0, 0), (self.past, self.future + self.chunk - 1)) + ((0, 0),) * (x.ndim - 2)
        x = jnp.pad(x, pad)
        # Block u covers padded frames [u*W, u*W + C): a static gather index.
        idx = np.arange(u)[:, None] * self.chunk + np.arange(self.context)[None, :]  # [U, C]
        return x[:, idx]

    def __call__(self, x: jax.Array, valid: jax.Array) -> jax.Array:
        """Args: x `[B, T, D]`; valid `[B, T]` bool (True = real frame). Returns `[B, T, N, H]`."""
        b, t, _ = x.shape
        n, h = self.num_heads, self.head_dim
        q = self.q_proj(x).reshape(b, t, n, h)
        k = self.k_proj(x).reshape(b, t, n, h)
        v = self.v_proj(x).reshape(b, t, n, h)
        # softplus(0) normalises the learned per-dim scale so a zero init means plain H^-1/2.
        q_scale = jnp.asarray(h**-0.5 / math.log(2.0), jnp.float32).astype(q.dtype)
        per_dim = jax.nn.softplus(self.per_dim_scale[...]).astype(q.dtype)
        q = q * q_scale * per_dim[None, None, None, :]

        qb = self._blocks(q)  # [B, U, W, N, H]
        kb, vb = self._context(k), self._context(v)  # [B, U, C, N, H]
        vmask = self._context(valid)  # [B, U, C]
        u = qb.shape[1]

        # Relative positions P, P-1, ..., -R (F = P + R + 1 of them).
        span = self.past + self.future + 1
        sin = self.relative_position_embedding(np.arange(self.past, -self.future - 1, -1), q.dtype)
        sin = sin.reshape(span, n, h)

        ac = jnp.einsum("BUWNH,BUCNH->BNUWC", qb, kb)
        bd = jnp.einsum("BUWNH,FNH->BNUWF", qb, sin)
        # Relative shift (upstream's pad / flatten / slice trick): out[w, c] = bd[w, c - w].
        bd = jnp.pad(bd, ((0, 0),) * 4 + ((0, self.context + 1 - span),))
        bd = bd.reshape(b, n, u, self.chunk * (self.context + 1))[..., : self.chunk * self.context]
        logits = ac + bd.reshape(b, n, u, self.chunk, self.context)  # [B, N, U, W, C]

        cap = jnp.asarray(self.cap, jnp.float32).astype(logits.dtype)
        logits = jnp.tanh(logits / cap) * cap
        # Upstream's local window: w <= c <= w + P + R (lower and upper band of a [W, C] grid).
        w_idx, c_idx = np.arange(self.chunk)[:, None], np.arange(self.context)[None, :]
        window = jnp.asarray((c_idx >= w_idx) & (c_idx <= w_idx + self.past + self.future))
        keep = vmask[:, None, :, None, :] & window[None, None, None, :, :]
        logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(vb.dtype)
        # A masked probability is exactly 0, but 0 * inf = NaN: values of masked keys are
        # replaced, not multiplied away, so a non-finite padded frame cannot reach a real one.
        vb = jnp.where(vmask[:, :, :, None, None], vb, jnp.zeros((), vb.dtype))
        out = jnp.einsum("BNUWC,BUCNH->BUWNH", probs, vb)
        return out.reshape(b, u * self.chunk, n, h)[:, :t]


class ConformerAttention(nnx.Module):
    """Clip, pre-norm, chunked attention, output projection, clip, post-norm, residual."""

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        d = cfg.hidden_size
        self.bound = cfg.gradient_clipping
        self.pre_attn_norm = RMSNorm(d, param_dtype=param_dtype)
        self.attn = ChunkedLocalAttention(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post = linear(d, d, dtype, param_dtype, rngs)
        self.post_norm = RMSNorm(d, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, valid: jax.Array) -> jax.Array:
        h = self.attn(self.pre_attn_norm(clip(x, self.bound)), valid)  # [B, T, N, H]
        h = self.post(h.reshape(*h.shape[:2], -1))
        return x + self.post_norm(clip(h, self.bound))
