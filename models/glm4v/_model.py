"""The GLM-4.1V vision tower (transformers `Glm4vVisionModel`) and its sync-free entry points."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

import jaxsync
from jaxsync.check import entry_point
from jaxsync.models.glm4v._config import Glm4vVisionConfig
from jaxsync.models.glm4v._interp import interpolate_pos_embed
from jaxsync.models.glm4v._modules import (
    AttentionImpl,
    Block,
    PatchMerger,
    RMSNorm,
    _linear,
    rotary_cos_sin,
)
from jaxsync.models.glm4v._plan import VisionPlan, plan_batch


class PatchEmbed(nnx.Module):
    """`Glm4vVisionPatchEmbed`: a Conv3d whose kernel equals its stride and the whole patch, i.e. a
    linear map of the flattened (channel, frame, row, col) patch."""

    def __init__(self, cfg: Glm4vVisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.proj = _linear(cfg.patch_dim, cfg.hidden_size, True, dtype, rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.proj(pixels.astype(self.proj.kernel.dtype))


class Embeddings(nnx.Module):
    """`Glm4vVisionEmbeddings`: the S x S learned position table, sampled bicubically."""

    def __init__(self, cfg: Glm4vVisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        n = cfg.table_side**2
        self.position_embedding = nnx.Param(
            jax.random.normal(rngs.params(), (n, cfg.hidden_size), dtype)
        )

    def __call__(self, h, w, th, tw) -> jax.Array:
        table = self.position_embedding[...]
        # Interpolated in float32, then cast to the table dtype before the add, as upstream.
        return interpolate_pos_embed(table, h, w, th, tw).astype(table.dtype)  # [P, D]


class Glm4vVisionModel(nnx.Module):
    """The vision tower over a packed, bucket-padded patch sequence.

    Args:
      cfg: the config.
      dtype: parameter and compute dtype (upstream runs the tower in the model dtype).
      rngs: for random initialisation (the loader builds the module abstractly).
      attention: "xla" (masked dense softmax), "cudnn" (flash attention with the segment mask),
        or "auto" (cuDNN on GPU for bf16/fp16, else XLA).
    """

    def __init__(
        self,
        cfg: Glm4vVisionConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        attention: AttentionImpl = "auto",
    ):
        self.cfg = cfg
        m, d = cfg.spatial_merge_size, cfg.hidden_size
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.post_conv_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.embeddings = Embeddings(cfg, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [Block(cfg, dtype=dtype, rngs=rngs, attention=attention) for _ in range(cfg.depth)]
        )
        self.post_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        # Conv2d(kernel = stride = m) over one merge block == a linear map of the flattened
        # (inner-row, inner-col, channel) block.
        self.downsample = _linear(m * m * d, cfg.out_hidden_size, True, dtype, rngs)
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)

    def pos_embeds(self, meta: jaxsync.Packed) -> jax.Array:
        """Interpolated position embeddings [P, D] for the packed batch described by `meta`."""
        return self.embeddings(meta["h"], meta["w"], meta["th"], meta["tw"])

    def __call__(self, pixels: jax.Array, meta: jaxsync.Packed) -> tuple[jax.Array, jax.Array]:
        """Runs the tower.

        Args:
          pixels: [P, C*T*p*p] flattened patches in merge-block order, P a multiple of m*m.
          meta: `upload_packed(plan.fields)`: h, w, th, tw, seg, each [P].

        Returns:
          (hidden, merged): [P/(m*m), out_hidden_size] after the downsample conv, and after the
          patch merger (upstream's `last_hidden_state` and `pooler_output`).
        """
        cfg = self.cfg
        x = self.post_conv_layernorm(self.patch_embed(pixels))  # [P, D]
        x = x + self.pos_embeds(meta)
        cos, sin = rotary_cos_sin(meta["h"], meta["w"], cfg.head_dim, cfg.rope_theta)  # [P, H]
        seg = meta["seg"]
        same_segment = seg[:, None] == seg[None, :]  # [P, P]
        for block in self.blocks:
            x = block(x, cos, sin, same_segment)
        x = self.post_layernorm(x)
        m2 = cfg.spatial_merge_size**2
        hidden = self.downsample(x.reshape(x.shape[0] // m2, m2 * x.shape[1]))  # [G, O]
        return hidden, self.merger(hidden)


@struct.dataclass
class VisionOutput:
    """Tower outputs on device plus host-side bookkeeping (never read back).

    Attributes:
      embeddings: [G_bucket, out_hidden_size] merged tokens; rows >= `num_tokens` are padding.
      hidden: [G_bucket, out_hidden_size] the same before the patch merger.
      num_tokens: real merged tokens (host int).
      tokens_per_item: merged tokens of each input item, in order (host ints).
    """

    embeddings: jax.Array
    hidden: jax.Array
    num_tokens: int = struct.field(pytree_node=False)
    tokens_per_item: tuple[int, ...] = struct.field(pytree_node=False)

    def split(self) -> list[jax.Array]:
        """Per-item embeddings (static slices: dispatched, never synchronised)."""
        bounds = np.cumsum((0, *self.tokens_per_item)).tolist()
        return [self.embeddings[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class Glm4vVisionEncoder:
    """Host entry points around a `Glm4vVisionModel`: plan on the host, one packed upload, one
    jitted program per bucket.

    Args:
      model: the tower (e.g. from `load_vision_model`).
      group_buckets: buckets for the merged-token count (default `DEFAULT_GROUP_BUCKETS`).
      placement: device or sharding for uploads (None: default device).
    """

    def __init__(
        self,
        model: Glm4vVisionModel,
        *,
        group_buckets: Sequence[int] | None = None,
        placement=None,
    ):
        self.model = model
        self.cfg = model.cfg
        self.dtype = model.post_layernorm.weight.dtype
        self.group_buckets = tuple(group_buckets) if group_buckets else None
        self.placement = placement
        self._forward = jaxsync.jit_method(model, "__call__")
        self._pos_embeds = jaxsync.jit_method(model, "pos_embeds")

    def plan(self, grid_thw, num_patches: int | None = None) -> VisionPlan:
        """The host plan of a batch (validates `grid_thw`)."""
        return plan_batch(
            grid_thw, self.cfg, num_patches=num_patches, group_buckets=self.group_buckets
        )

    def _pixels(self, pixels, plan: VisionPlan) -> jax.Array:
        if isinstance(pixels, jax.Array):
            # Already on device: only shapes (static metadata) are checked, nothing is read.
            if pixels.ndim != 2 or pixels.shape[1] != self.cfg.patch_dim:
                raise ValueError(f"pixels must be [P, {self.cfg.patch_dim}], got {pixels.shape}")
            if pixels.shape[0] != plan.padded_patches:
                raise ValueError(
                    f"a device pixel array must already be padded to the bucket: "
                    f"{plan.padded_patches} rows, got {pixels.shape[0]}"
                )
            return pixels
        host = np.zeros((plan.padded_patches, self.cfg.patch_dim), self.dtype)
        host[: plan.num_patches] = pixels  # padding patches are zero pixels
        return jaxsync.async_h2d(host, placement=self.placement, copy=False)  # `host` is private

    @entry_point
    def __call__(self, pixels, grid_thw) -> VisionOutput:
        """Encodes a packed batch of images and videos.

        Args:
          pixels: [sum(t*h*w), C*T*p*p] host array of flattened patches in merge-block order (as
            the HF image processor emits them), or a device array already padded to the bucket.
          grid_thw: [B, 3] host (t, h, w) per item, in patches.

        Returns:
          `VisionOutput` with the merged tokens of all items, padded to the bucket.

        Raises:
          ValueError: empty batch, h/w not multiples of the merge size, or a patch count that
            does not match `grid_thw` (all checked on the host before any dispatch).
        """
        shape = np.shape(pixels)
        if len(shape) != 2 or shape[1] != self.cfg.patch_dim:
            raise ValueError(f"pixels must be [P, {self.cfg.patch_dim}], got {shape}")
        is_device = isinstance(pixels, jax.Array)
        plan = self.plan(grid_thw, None if is_device else shape[0])
        meta = jaxsync.upload_packed(plan.fields, placement=self.placement)
        hidden, merged = self._forward(self._pixels(pixels, plan), meta)
        return VisionOutput(merged, hidden, plan.num_tokens, plan.tokens_per_item)

    @entry_point
    def pos_embeds(self, grid_thw) -> jax.Array:
        """Interpolated position embeddings of a batch alone: [P_bucket, D] in the model dtype
        (upstream's `pos_embeds_interpolate`); rows >= sum(t*h*w) are padding."""
        plan = self.plan(grid_thw)
        return self._pos_embeds(jaxsync.upload_packed(plan.fields, placement=self.placement))
