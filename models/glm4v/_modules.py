"""The GLM-4.1V vision tower (transformers `Glm4vVisionModel`) as flax.nnx modules, and its pure
forward.

All layers run in the parameter dtype like upstream; RMSNorm statistics, rotary and softmax are
computed in float32 exactly where upstream upcasts. `forward(model, pixels, meta)` is callable
inside any jit of a server's (weights are arguments); `Glm4vVisionEncoder` compiles the same
function for host callers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync.models._activations import activation, gelu
from jaxsync.models._attention import AttentionImpl
from jaxsync.models.glm4v._attention import Attention, RaggedSegments, linear, rotary_cos_sin
from jaxsync.models.glm4v._config import Glm4vVisionConfig
from jaxsync.models.glm4v._interp import interpolate_pos_embed
from jaxsync.models.glm4v._plan import SEGMENT_GROUP


class RMSNorm(nnx.Module):
    """`Glm4vRMSNorm`: normalise in float32, cast back, then scale in the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)  # [P, D]
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        return self.weight[None, :] * (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)


class GatedMlp(nnx.Module):
    """down(act(gate(x)) * up(x)), no biases (the block MLP and the merger's tail)."""

    def __init__(self, dim: int, hidden: int, act: str, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.act = act
        self.gate_proj = linear(dim, hidden, False, dtype, rngs)
        self.up_proj = linear(dim, hidden, False, dtype, rngs)
        self.down_proj = linear(hidden, dim, False, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """`Glm4vVisionBlock`: pre-norm attention and MLP with residuals."""

    def __init__(
        self,
        cfg: Glm4vVisionConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        attention: AttentionImpl | str = "auto",
    ):
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, impl=attention)
        # Upstream quirk kept: the block MLP is out_hidden_size wide, not intermediate_size.
        self.mlp = GatedMlp(
            cfg.hidden_size, cfg.out_hidden_size, cfg.hidden_act, dtype=dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array, *attn_args: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), *attn_args)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """`Glm4vVisionPatchMerger`: proj -> LayerNorm -> exact GELU -> gated MLP."""

    def __init__(self, cfg: Glm4vVisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        dim = cfg.out_hidden_size
        self.proj = linear(dim, dim, False, dtype, rngs)
        # torch LayerNorm defaults: eps 1e-5, two-pass variance.
        self.post_projection_norm = nnx.LayerNorm(
            dim, epsilon=1e-5, use_fast_variance=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.mlp = GatedMlp(dim, cfg.intermediate_size, cfg.hidden_act, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = gelu(self.post_projection_norm(self.proj(x)))
        return self.mlp(x)


class PatchEmbed(nnx.Module):
    """`Glm4vVisionPatchEmbed`: a Conv3d whose kernel equals its stride and the whole patch, i.e.
    a linear map of the flattened (channel, frame, row, col) patch."""

    def __init__(self, cfg: Glm4vVisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.proj = linear(cfg.patch_dim, cfg.hidden_size, True, dtype, rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.proj(pixels.astype(self.proj.kernel.dtype))


class PositionEmbedding(nnx.Module):
    """`Glm4vVisionEmbeddings`: the S x S learned position table, sampled bicubically."""

    def __init__(self, cfg: Glm4vVisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        n = cfg.table_side**2
        self.position_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (n, cfg.hidden_size), dtype)
        )

    def __call__(self, meta: jaxsync.Packed) -> jax.Array:
        """Interpolated embeddings [P, D] in the table dtype for the batch `meta` describes."""
        return pos_embeds(self.position_embedding[...], meta)


def pos_embeds(table: jax.Array, meta: jaxsync.Packed) -> jax.Array:
    """The table [S*S, D] sampled at every patch of `meta` (h, w, th, tw): [P, D] in its dtype
    (interpolated in float32, cast before the add, as upstream)."""
    out = interpolate_pos_embed(table, meta["h"], meta["w"], meta["th"], meta["tw"])
    return out.astype(table.dtype)


class Glm4vVisionTower(nnx.Module):
    """The vision tower's parameters; `forward` runs it over a packed, bucket-padded batch.

    Args:
      cfg: the config.
      dtype: parameter and compute dtype (upstream runs the tower in the model dtype).
      rngs: for random initialisation (the loader builds the module abstractly).
      attention: "xla" (masked dense softmax), "cudnn" (flash attention with the segment mask),
        "auto" (cuDNN on GPU for bf16/fp16, else XLA) or "dot_product" (the cuDNN call on XLA).
    """

    def __init__(
        self,
        cfg: Glm4vVisionConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        attention: AttentionImpl | str = "auto",
    ):
        self.cfg = cfg
        m, d = cfg.spatial_merge_size, cfg.hidden_size
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.post_conv_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.embeddings = PositionEmbedding(cfg, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [Block(cfg, dtype=dtype, rngs=rngs, attention=attention) for _ in range(cfg.depth)]
        )
        self.post_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        # Conv2d(kernel = stride = m) over one merge block == a linear map of the flattened
        # (inner-row, inner-col, channel) block.
        self.downsample = linear(m * m * d, cfg.out_hidden_size, True, dtype, rngs)
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)

    @property
    def dtype(self) -> jnp.dtype:
        return self.post_layernorm.weight.dtype


def forward(
    model: Glm4vVisionTower, pixels: jax.Array, meta: jaxsync.Packed
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tower over one packed batch; pure, callable inside any jit.

    Args:
      model: the tower (e.g. `nnx.merge(graphdef, state)` inside a server's jit).
      pixels: [P, C*T*p*p] flattened patches in merge-block order, P a multiple of m*m (padding
        rows past the real patches are zeros).
      meta: `jaxsync.upload_packed(plan.fields)` of a `VisionPlan`.

    Returns:
      (merged, hidden, finite): [G, out_hidden_size] tokens after the patch merger and before
      it (upstream's `pooler_output` and `last_hidden_state`), G = P / m^2; and finite, bool
      [G]: entry i < num_items says whether every output token of item i is finite.
    """
    cfg = model.cfg
    x = model.post_conv_layernorm(model.patch_embed(pixels))  # [P, D]
    x = x + model.embeddings(meta)
    cos, sin = rotary_cos_sin(meta["h"], meta["w"], cfg.head_dim, cfg.rope_theta)  # [P, H]
    groups = tuple(meta[name] for name in meta.names if name.startswith(SEGMENT_GROUP))
    if groups:  # the "segments" layout: each segment attends alone, batched by length
        segments = groups
    elif "seq_lengths" in meta.names:  # the "ragged" layout
        segments = RaggedSegments(meta["seq_lengths"], meta["seq_offsets"], meta["seg"])
    else:
        seg = meta["seg"]
        segments = seg[:, None] == seg[None, :]  # [P, P]
    x = jaxsync.run_layers(model.blocks, x, cos, sin, segments)
    x = model.post_layernorm(x)
    m2 = cfg.spatial_merge_size**2
    g = x.shape[0] // m2
    hidden = model.downsample(x.reshape(g, m2 * x.shape[1]))  # [G, O]
    merged = model.merger(hidden)
    # Per item: every token finite. Padding tokens carry item id num_items (< G when present).
    token_ok = jnp.isfinite(merged).all(-1) & jnp.isfinite(hidden).all(-1)  # [G]
    item = meta["item"][::m2]  # [G]
    finite = jax.ops.segment_min(token_ok.astype(jnp.int32), item, num_segments=g) > 0
    return merged, hidden, finite
