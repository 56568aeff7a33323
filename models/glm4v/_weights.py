"""Checkpoint mapping for the GLM-4.1V vision tower (keys `model.visual.*` of
transformers 5.x `Glm4vForConditionalGeneration`, or the bare `Glm4vVisionModel` keys)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.models.glm4v._config import Glm4vVisionConfig
from jaxsync.models.glm4v._model import Glm4vVisionModel
from jaxsync.weights import Rule, conv, linear, load_weights


# Prefix of the tower inside a full Glm4vForConditionalGeneration checkpoint (transformers 5.x).
FULL_MODEL_PREFIX = "model.visual."


def _flat_patch(w: jax.Array) -> jax.Array:
    """Conv3d [D, C, T, p, p] -> linear kernel [C*T*p*p, D] over the flattened patch."""
    return jnp.transpose(w.reshape(w.shape[0], -1))


def _flat_block(w: jax.Array) -> jax.Array:
    """Conv2d [O, D, m, m] -> linear kernel [m*m*D, O] over the flattened (row, col, ch) block."""
    return conv(2)(w).reshape(-1, w.shape[0])


RULES: tuple[Rule, ...] = (
    Rule(r"patch_embed\.proj\.weight", "patch_embed.proj.kernel", _flat_patch),
    Rule(r"patch_embed\.proj\.bias", "patch_embed.proj.bias"),
    Rule(r"post_conv_layernorm\.weight", "post_conv_layernorm.weight"),
    Rule(r"embeddings\.position_embedding\.weight", "embeddings.position_embedding"),
    Rule(r"blocks\.(\d+)\.(norm[12])\.weight", r"blocks.\1.\2.weight"),
    Rule(r"blocks\.(\d+)\.attn\.(qkv|proj)\.weight", r"blocks.\1.attn.\2.kernel", linear),
    Rule(r"blocks\.(\d+)\.attn\.qkv\.bias", r"blocks.\1.attn.qkv.bias"),
    Rule(
        r"blocks\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"blocks.\1.mlp.\2_proj.kernel", linear
    ),
    Rule(r"post_layernorm\.weight", "post_layernorm.weight"),
    Rule(r"downsample\.weight", "downsample.kernel", _flat_block),
    Rule(r"downsample\.bias", "downsample.bias"),
    Rule(r"merger\.proj\.weight", "merger.proj.kernel", linear),
    Rule(r"merger\.post_projection_norm\.weight", "merger.post_projection_norm.scale"),
    Rule(r"merger\.post_projection_norm\.bias", "merger.post_projection_norm.bias"),
    Rule(r"merger\.(gate|up|down)_proj\.weight", r"merger.mlp.\1_proj.kernel", linear),
)


def load_vision_model(
    checkpoint: str | Path,
    cfg: Glm4vVisionConfig,
    *,
    prefix: str = FULL_MODEL_PREFIX,
    dtype=jnp.float32,
    allow_cast: bool = False,
    attention: str = "auto",
) -> Glm4vVisionModel:
    """Loads the vision tower from a safetensors checkpoint through the strict loader.

    Args:
      checkpoint: file, sharded index or directory.
      cfg: the tower config (`Glm4vVisionConfig.from_hf_config`).
      prefix: key prefix of the tower: "model.visual." for a full transformers 5.x checkpoint,
        "" for a bare `Glm4vVisionModel` state dict. Keys outside the prefix are ignored.
      dtype: parameter and compute dtype.
      allow_cast: allow float dtype conversion (e.g. an fp32 checkpoint into a bf16 tower).
      attention: attention implementation (see `Glm4vVisionModel`).

    Raises:
      jaxsync.weights.WeightError: a tower key no rule maps, a missing parameter, or a shape or
        dtype mismatch, naming the key.
    """
    return load_weights(
        lambda: Glm4vVisionModel(cfg, dtype=dtype, rngs=nnx.Rngs(0), attention=attention),
        checkpoint,
        RULES,
        select=re.escape(prefix) if prefix else None,
        strip=prefix,
        allow_cast=allow_cast,
    )
