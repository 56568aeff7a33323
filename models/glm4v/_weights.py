"""Checkpoint mapping for the GLM-4.1V vision tower (keys `model.visual.*` of
transformers 5.x `Glm4vForConditionalGeneration`, or the bare `Glm4vVisionModel` keys)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxsync.models.glm4v._config import Glm4vVisionConfig
from jaxsync.models.glm4v._modules import Glm4vVisionTower
from jaxsync.weights import (
    PartitionRules,
    Rule,
    Transform,
    WeightError,
    checkpoint_dtype,
    conv,
    linear,
    load_weights,
)


# Prefix of the tower inside a full Glm4vForConditionalGeneration checkpoint (transformers 5.x).
FULL_MODEL_PREFIX = "model.visual."


def _flat_patch(cfg: Glm4vVisionConfig) -> Transform:
    """Conv3d [D, C, T, p, p] -> linear kernel [C*T*p*p, D] over the flattened patch.

    The stored layout is checked before the reshape: a kernel with C and T swapped has the same
    element count and would otherwise load scrambled.
    """
    c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size

    def stored(shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) != 2 or shape[0] != c * t * p * p:
            raise ValueError(f"flat_patch maps onto [{c * t * p * p}, D], not {shape}")
        return (shape[1], c, t, p, p)

    return Transform(lambda w: w.reshape(w.shape[0], -1).T, stored, "flat_patch")


def _flat_block(cfg: Glm4vVisionConfig) -> Transform:
    """Conv2d [O, D, m, m] -> linear kernel [m*m*D, O] over the flattened (row, col, ch) block."""
    m = cfg.spatial_merge_size

    def stored(shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) != 2 or shape[0] % (m * m):
            raise ValueError(f"flat_block maps onto [m*m*D, O] with m={m}, not {shape}")
        return (shape[1], shape[0] // (m * m), m, m)

    return Transform(lambda w: conv(2)(w).reshape(-1, w.shape[0]), stored, "flat_block")


def _head_major_qkv(cfg: Glm4vVisionConfig, bias: bool) -> Transform:
    """Fused qkv, stored [3*N*H, D] (q, k, v blocks, each head-major) -> kernel [D, N*3*H]
    (bias [N*3*H]) with each head's q, k and v columns side by side.

    In this order a split of the output columns into equal parts over a "model" axis of a size
    dividing N gives every device whole heads of q, k and v: attention then runs on local
    columns with no gather (`Attention` reshapes to [P, N, 3, H]). The stored layout is
    transformers' (`Glm4vVisionAttention` reshapes to [P, 3, N, H]).
    """
    n, h = cfg.num_heads, cfg.head_dim

    def head_major(w):
        if bias:  # [3*N*H] -> [N*3*H]
            return w.reshape(3, n, h).transpose(1, 0, 2).reshape(-1)
        d = w.shape[1]  # [3*N*H, D] -> [D, N*3*H]
        return w.reshape(3, n, h, d).transpose(3, 1, 0, 2).reshape(d, -1)

    def stored(shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) != (1 if bias else 2) or shape[-1] != 3 * n * h:
            raise ValueError(f"head_major_qkv maps onto [..., {3 * n * h}], not {shape}")
        return shape if bias else (shape[1], shape[0])

    return Transform(head_major, stored, "head_major_qkv_bias" if bias else "head_major_qkv")


def rules(cfg: Glm4vVisionConfig) -> tuple[Rule, ...]:
    """The HF key rules of a tower with this config (the conv layouts depend on its sizes)."""
    return (
        Rule(r"patch_embed\.proj\.weight", "patch_embed.proj.kernel", _flat_patch(cfg)),
        Rule(r"patch_embed\.proj\.bias", "patch_embed.proj.bias"),
        Rule(r"post_conv_layernorm\.weight", "post_conv_layernorm.weight"),
        Rule(r"embeddings\.position_embedding\.weight", "embeddings.position_embedding"),
        Rule(r"blocks\.(\d+)\.(norm[12])\.weight", r"blocks.\1.\2.weight"),
        Rule(
            r"blocks\.(\d+)\.attn\.qkv\.weight",
            r"blocks.\1.attn.qkv.kernel",
            _head_major_qkv(cfg, bias=False),
        ),
        Rule(
            r"blocks\.(\d+)\.attn\.qkv\.bias",
            r"blocks.\1.attn.qkv.bias",
            _head_major_qkv(cfg, bias=True),
        ),
        Rule(r"blocks\.(\d+)\.attn\.proj\.weight", r"blocks.\1.attn.proj.kernel", linear),
        Rule(
            r"blocks\.(\d+)\.mlp\.(gate|up|down)_proj\.weight",
            r"blocks.\1.mlp.\2_proj.kernel",
            linear,
        ),
        Rule(r"post_layernorm\.weight", "post_layernorm.weight"),
        Rule(r"downsample\.weight", "downsample.kernel", _flat_block(cfg)),
        Rule(r"downsample\.bias", "downsample.bias"),
        Rule(r"merger\.proj\.weight", "merger.proj.kernel", linear),
        Rule(r"merger\.post_projection_norm\.weight", "merger.post_projection_norm.scale"),
        Rule(r"merger\.post_projection_norm\.bias", "merger.post_projection_norm.bias"),
        Rule(r"merger\.(gate|up|down)_proj\.weight", r"merger.mlp.\1_proj.kernel", linear),
    )


PARTITION_RULES: PartitionRules = (
    (r"blocks\.layer\.attn\.qkv\.kernel", (None, "model")),
    (r"blocks\.layer\.attn\.qkv\.bias", ("model",)),
    (r"blocks\.layer\.attn\.proj\.kernel", ("model", None)),
    (r"mlp\.(gate|up)_proj\.kernel", (None, "model")),
    (r"mlp\.down_proj\.kernel", ("model", None)),
)
"""Megatron-style tensor parallelism over a "model" mesh axis.

The fused qkv is loaded head-major (`[D, N*3*H]`, see `_head_major_qkv`), so its column split
gives each device whole heads of q, k and v; the attention output projection and the MLP down
projections are split by input row, so each attention and each MLP ends in one all-reduce of
`[P, D]` partial sums. Norms, the position table, the patch embedding, the downsample conv and
the merger's `proj` stay replicated. The paths are the stacked blocks' (`blocks.layer.*`) and
the axes describe one layer: the loader keeps the leading layer axis unsharded. Axis names a
mesh lacks and sizes an axis does not divide fall back to replication (`num_heads`,
`out_hidden_size` and `intermediate_size` must divide by the "model" size for a full split).

Collectives of one forward on a `("data", "model")` mesh (inputs replicated):

| where                          | all-reduce                       | all-gather |
| ------------------------------ | -------------------------------- | ---------- |
| each block (the scan's body)   | 2: after `attn.proj`, `mlp.down` | 0          |
| patch merger                   | 1: after `merger.mlp.down_proj`  | 0          |
| whole forward (HLO op count)   | 3 at any depth                   | 0          |
"""


def _prefix_and_dtype(checkpoint: str | Path) -> tuple[str, Any]:
    """The tower's key prefix ("model.visual." in a full checkpoint, "" in a bare tower) and
    its float dtype, from the headers alone."""
    try:
        return FULL_MODEL_PREFIX, checkpoint_dtype(
            checkpoint, select=re.escape(FULL_MODEL_PREFIX), strip=FULL_MODEL_PREFIX
        )
    except WeightError as full_error:
        try:
            return "", checkpoint_dtype(checkpoint, select=r"(patch_embed|blocks|merger)\.")
        except WeightError:
            raise full_error from None


def load_model(
    checkpoint: str | Path,
    cfg: Glm4vVisionConfig | None = None,
    *,
    dtype: Any = None,
    mesh: Mesh | None = None,
    partition_rules: PartitionRules = PARTITION_RULES,
) -> Glm4vVisionTower:
    """Loads the vision tower from a safetensors checkpoint through the strict loader.

    The tower's keys are `model.visual.*` in a full `Glm4vForConditionalGeneration` checkpoint
    (transformers 5.x) or bare `Glm4vVisionModel` keys; other keys are never read.

    Args:
      checkpoint: file, sharded index or directory.
      cfg: the tower config; None reads `config.json` beside the checkpoint
        (`Glm4vVisionConfig.from_hf_config`).
      dtype: None keeps the checkpoint's float dtype (a bf16 checkpoint loads at bf16); a float
        dtype casts every float tensor to it.
      mesh: place each parameter on this mesh as it is read (`partition_rules` over it).
      partition_rules: `(regex over the parameter path, mesh axes)` pairs, first match wins.

    Raises:
      jaxsync.weights.WeightError: a tower key no rule maps, a missing parameter, a shape or
        dtype mismatch, or an unreadable file, naming the key.
    """
    if cfg is None:
        cfg = Glm4vVisionConfig.from_hf_config(checkpoint)  # the config.json beside it
    if not isinstance(cfg, Glm4vVisionConfig):
        raise TypeError(f"cfg must be a Glm4vVisionConfig or None, got {type(cfg).__name__}")
    prefix, stored = _prefix_and_dtype(checkpoint)
    build_dtype = stored if dtype is None else jnp.dtype(dtype)
    return load_weights(
        lambda: Glm4vVisionTower(cfg, dtype=build_dtype, rngs=nnx.Rngs(0)),
        checkpoint,
        rules(cfg),
        select=re.escape(prefix) if prefix else None,
        strip=prefix,
        dtype=dtype,
        mesh=mesh,
        partition_rules=partition_rules if mesh is not None else None,
    )
