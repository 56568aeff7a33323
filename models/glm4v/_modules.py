"""The GLM-4.1V vision tower (transformers `Glm4vVisionModel`) as flax.nnx modules, and its pure
forward.

All layers run in the parameter dtype like upstream; RMSNorm statistics, rotary and softmax are
computed in float32 exactly where upstream upcasts. The blocks are one `jaxsync.LayerStack`
(parameters stacked [L, ...], run as one scan). `forward(model, pixels, meta)` is callable inside
any jit of a server's (weights are arguments); `Glm4vVisionEncoder` compiles the same function
for host callers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync._out_sharding import OutSharding, place_rows
from jaxsync.models._activations import activation, gelu
from jaxsync.models._attention import AttentionImpl, resolve_attention
from jaxsync.models.glm4v._attention import Attention, RaggedSegments, linear, rotary_cos_sin
from jaxsync.models.glm4v._config import Glm4vVisionConfig
from jaxsync.models.glm4v._interp import interpolate_pos_embed


_ATTENTIONS = ("xla", "cudnn", "dot_product")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Glm4vTowerConfig(Glm4vVisionConfig):
    """A tower's config (`tower.cfg`): the checkpoint's fields and the tower's resolved attention,
    so that `plan(grid_thw, tower.cfg)` picks the attention layout the tower's encoder runs.

    Attributes:
      attention: "xla" (masked dense softmax), "cudnn" (flash attention) or "dot_product" (the
        cuDNN call shape run by XLA).
    """

    attention: str = "xla"

    def __post_init__(self):
        super().__post_init__()
        if self.attention not in _ATTENTIONS:
            raise ValueError(f"attention must be one of {_ATTENTIONS}, got {self.attention!r}")


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
        attention: AttentionImpl | str = "xla",
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
    """The table [S*S, D] sampled at every patch of `meta` (a `Glm4vMeta`'s h, w, th, tw):
    [P, D] in its dtype (interpolated in float32, cast before the add, as upstream)."""
    out = interpolate_pos_embed(table, meta.h, meta.w, meta.th, meta.tw)
    return out.astype(table.dtype)


class Glm4vVisionTower(nnx.Module):
    """The vision tower's parameters; `forward` runs it over a packed, bucket-padded batch.

    Args:
      cfg: the config.
      dtype: parameter and compute dtype (upstream runs the tower in the model dtype).
      rngs: for random initialisation (the loader builds the module abstractly).
      attention: "xla" (masked dense softmax), "cudnn" (flash attention with the segment mask),
        "auto" (cuDNN on GPU for bf16/fp16, else XLA) or "dot_product" (the cuDNN call on XLA).

    Attributes:
      cfg: a `Glm4vTowerConfig`: `cfg`'s fields and the resolved attention.
      blocks: the `cfg.depth` blocks, a `jaxsync.LayerStack` (`blocks.at(i)` is block i).
    """

    def __init__(
        self,
        cfg: Glm4vVisionConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        attention: AttentionImpl | str = "auto",
    ):
        if attention != "dot_product":
            attention = resolve_attention(attention, dtype, cfg.head_dim)
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Glm4vVisionConfig)}
        self.cfg = cfg = Glm4vTowerConfig(**fields, attention=attention)
        m, d = cfg.spatial_merge_size, cfg.hidden_size
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.post_conv_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.embeddings = PositionEmbedding(cfg, dtype=dtype, rngs=rngs)
        self.blocks = jaxsync.LayerStack(
            lambda r: Block(cfg, dtype=dtype, rngs=r, attention=attention), cfg.depth, rngs=rngs
        )
        self.post_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        # Conv2d(kernel = stride = m) over one merge block == a linear map of the flattened
        # (inner-row, inner-col, channel) block.
        self.downsample = linear(m * m * d, cfg.out_hidden_size, True, dtype, rngs)
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)

    @property
    def dtype(self) -> jnp.dtype:
        return self.post_layernorm.weight.dtype


def _check_fits(cfg: Glm4vVisionConfig, pixels: jax.Array, meta) -> None:
    """Trace-time check that the pixels are the plan's padded batch (a clear error instead of a
    broadcast error deep in the tower)."""
    p = meta.h.shape[0]
    if tuple(pixels.shape) != (p, cfg.patch_dim):
        raise ValueError(
            f"pixels of shape {tuple(pixels.shape)} do not fit the plan: it pads the batch to "
            f"[{p}, {cfg.patch_dim}] (padded_patches, patch_dim)"
        )
    if p % cfg.spatial_merge_size**2:
        raise ValueError(
            f"the plan's {p} patches are not whole merge blocks of {cfg.spatial_merge_size**2}"
        )


def _segments(meta) -> jax.Array | tuple | RaggedSegments:
    """How each segment attends only to itself, from the layout the meta's static shapes say."""
    if meta.seq_lengths.shape[0]:  # "ragged"
        return RaggedSegments(meta.seq_lengths, meta.seq_offsets, meta.seg)
    groups = tuple(g for g in (meta.group_0, meta.group_1, meta.group_2, meta.group_3) if g.size)
    if groups:  # "segments": each segment attends alone, batched by length
        return groups
    seg = meta.seg
    return seg[:, None] == seg[None, :]  # "dense": [P, P]


def forward(
    model: Glm4vVisionTower,
    pixels: jax.Array,
    meta: jaxsync.Packed,
    *,
    encoder_only: bool = False,
    out_sharding: OutSharding = None,
) -> jaxsync.Encoded:
    """The tower over one packed batch; pure, callable inside any jit.

    Args:
      model: the tower (e.g. `nnx.merge(graphdef, state)` inside a server's jit).
      pixels: [P, C*T*p*p] flattened patches in merge-block order, P = `plan.padded_patches`
        (padding rows past the real patches are zeros).
      meta: `jaxsync.upload_packed(plan)` of a `Glm4vPlan` (or its `Glm4vMeta` of arrays).
      encoder_only: stop before the patch merger (the rows are then its input).
      out_sharding: where the rows (and extras) go: a `Sharding`, a `PartitionSpec` over the
        weights' mesh (e.g. `P("data")` for a batch the server splits), or None: replicated
        over the weights' mesh (unconstrained for weights on one device).

    Returns:
      `jaxsync.Encoded`: rows [G, out_hidden_size] in the model dtype, the tokens after the
      patch merger (upstream's `pooler_output`), G = P / m^2, item i's `plan.lengths[i]` rows
      first in item order; finite, bool [I] (I = `plan.padded_items`): entry i < items says
      whether item i's rows (and their input) are all finite; extras {"hidden": the tokens
      before the merger} (upstream's `last_hidden_state`). With `encoder_only`, rows are those
      tokens before the merger and extras is None.

    Raises:
      ValueError: at trace time, pixels whose shape does not fit the plan.
    """
    cfg = model.cfg
    _check_fits(cfg, pixels, meta)
    x = model.post_conv_layernorm(model.patch_embed(pixels))  # [P, D]
    x = x + model.embeddings(meta)
    cos, sin = rotary_cos_sin(meta.h, meta.w, cfg.head_dim, cfg.rope_theta)  # [P, H]
    x = model.blocks(x, cos, sin, _segments(meta))
    x = model.post_layernorm(x)
    m2 = cfg.spatial_merge_size**2
    g = x.shape[0] // m2
    hidden = model.downsample(x.reshape(g, m2 * x.shape[1]))  # [G, O]
    token_ok = jnp.isfinite(hidden).all(-1)  # [G]
    if encoder_only:
        rows, extras = hidden, None
    else:
        rows, extras = model.merger(hidden), {"hidden": place_rows(model, hidden, out_sharding)}
        token_ok = token_ok & jnp.isfinite(rows).all(-1)
    rows = place_rows(model, rows, out_sharding)
    # Padding tokens carry item id I, outside every item: segment_min drops them.
    items = meta.item_tokens.shape[0]
    finite = jax.ops.segment_min(token_ok.astype(jnp.int32), meta.item[::m2], num_segments=items)
    return jaxsync.Encoded(rows, finite > 0, extras)


def forward_encoder_only(
    model: Glm4vVisionTower,
    pixels: jax.Array,
    meta: jaxsync.Packed,
    *,
    out_sharding: OutSharding = None,
) -> jaxsync.Encoded:
    """`forward(..., encoder_only=True)`: rows are the tokens before the patch merger."""
    return forward(model, pixels, meta, encoder_only=True, out_sharding=out_sharding)
