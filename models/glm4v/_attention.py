"""Attention of the GLM-4.1V vision tower: axial 2-D rotary, attention within each segment.

Every image (every video frame) is its own attention segment. A NaN or inf in one segment must
never reach another: a masked score is replaced by `jnp.where`, but a zero probability times a
non-finite value is still NaN, so values are made finite (by `jnp.where`) before the value
product. A segment's own non-finite keys still poison it, through its own scores, as upstream.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync import _compat
from jaxsync.models._attention import AttentionImpl, resolve_attention
from jaxsync.models.glm4v._config import Glm4vVisionConfig


def linear(n_in: int, n_out: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """A torch-layout-free `nnx.Linear` with parameters and compute in `dtype`."""
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


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


def finite_values(v: jax.Array) -> jax.Array:
    """`v` with non-finite entries replaced by 0, so a masked (zero) probability contributes
    exactly 0 to another segment's output instead of 0 * NaN = NaN."""
    return jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: str
) -> jax.Array:
    """Softmax attention of [..., Q, N, H] queries over [..., K, N, H] keys where `mask`
    [..., Q, K] is True; every query row has at least one True key.

    impl "xla" is the dense float32 softmax of upstream's eager path; "cudnn" (GPU) or
    "dot_product" (the same `jax.nn.dot_product_attention` call on XLA, for CPU tests).
    """
    v = finite_values(v)
    if impl != "xla":
        impl = "cudnn" if impl == "cudnn" else "xla"
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask[..., None, :, :], implementation=impl
        )
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("...QNH,...KNH->...NQK", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[..., None, :, :], scores * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [..., N, Q, K]
    return jnp.einsum("...NQK,...KNH->...QNH", probs, v)


def segment_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, groups: tuple[jax.Array, ...], impl: str
) -> jax.Array:
    """Attention of each segment alone, segments of similar length batched together.

    Args:
      q, k, v: [P, N, H] packed rows.
      groups: per group an int32 [G, L] index of the rows of G segments (each padded to L);
        index P marks an empty slot. Every real row appears once; rows in no group (bucket
        padding) get a zero output.

    Returns:
      [P, N, H]. Work is sum(G * L^2) instead of P^2, and no segment ever reads another's rows.
    """
    p = q.shape[0]
    out = jnp.zeros_like(v)
    for index in groups:
        q_g, k_g, v_g = (jnp.take(a, index, axis=0, mode="fill", fill_value=0) for a in (q, k, v))
        valid = index < p  # [G, L]
        mask = jnp.broadcast_to(valid[:, None, :], (*index.shape, index.shape[1]))  # [G, L, L]
        rows = masked_attention(q_g, k_g, v_g, mask, impl)  # [G, L, N, H]
        out = out.at[index].set(rows, mode="drop")  # empty slots fall off the end
    return out


class RaggedSegments(NamedTuple):
    """The "ragged" layout's segments of P packed rows (see `plan`)."""

    lengths: jax.Array  # int32 [M]: rows per segment, -1 in unused slots
    offsets: jax.Array  # int32 [M + 1]: first row of each segment, then the end; -1 after
    seg: jax.Array  # int32 [P]: each row's segment id (the mask where cuDNN is not used)


def ragged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: RaggedSegments, impl: str
) -> jax.Array:
    """Attention of each segment alone: cuDNN's ragged kernel (work sum(L^2), no block of
    another segment computed) where `impl` is "cudnn", else the same segments as a dense
    mask. q, k, v: [P, N, H]; returns [P, N, H]."""
    if impl == "cudnn":
        v = finite_values(v)  # as the dense form: a segment's own non-finite values give 0
        scale = q.shape[-1] ** -0.5
        return _compat.ragged_attention(q, k, v, segments.lengths, segments.offsets, scale)
    seg = segments.seg
    return masked_attention(q, k, v, seg[:, None] == seg[None, :], impl)


class Attention(nnx.Module):
    """`Glm4vVisionAttention` over a packed sequence, restricted to each segment (frame).

    Args:
      cfg: the config.
      dtype: parameter and compute dtype.
      rngs: initialisation.
      impl: "xla", "cudnn", "auto" (see `jaxsync.models._attention.resolve_attention`), or
        "dot_product" (the cuDNN call shape run by XLA: exercises that path on CPU).
    """

    def __init__(
        self,
        cfg: Glm4vVisionConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        impl: AttentionImpl | str = "auto",
    ):
        d = cfg.hidden_size
        self.impl = impl if impl == "dot_product" else resolve_attention(impl, dtype, cfg.head_dim)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = linear(d, 3 * d, cfg.attention_bias, dtype, rngs)
        self.proj = linear(d, d, False, dtype, rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array | tuple
    ) -> jax.Array:
        """x: [P, D]; cos, sin: [P, H]; segments: the dense [P, P] same-segment mask, the
        segment groups of `segment_attention`, or `RaggedSegments`. Returns [P, D]."""
        p = x.shape[0]
        # Head-major columns (the loader's layout): a split of the columns over a "model" axis
        # holds whole heads of q, k and v, so attention needs no gather.
        qkv = self.qkv(x).reshape(p, self.num_heads, 3, self.head_dim)  # [P, N, 3, H]
        q = _rotate(qkv[:, :, 0], cos, sin)  # [P, N, H]
        k = _rotate(qkv[:, :, 1], cos, sin)
        v = qkv[:, :, 2]
        if isinstance(segments, RaggedSegments):
            out = ragged_attention(q, k, v, segments, self.impl)
        elif isinstance(segments, tuple):
            out = segment_attention(q, k, v, segments, self.impl)
        else:
            # Every row keeps its own key (padding forms its own segment): no all-masked row.
            out = masked_attention(q, k, v, segments, self.impl)
        return self.proj(out.reshape(p, self.num_heads * self.head_dim))
