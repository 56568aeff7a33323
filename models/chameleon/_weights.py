"""Checkpoint mapping for the Chameleon image tower (`model.vqmodel.*`, `model.embed_tokens`).

The encoder's blocks are stacked by shape kind (`_layout.py`), so a block's checkpoint path
(`vqmodel.encoder.down.2.block.0`) maps onto a slice of its stack (`vqmodel.encoder.res.w256.1`,
which the loader fills as slice 1 of `res.w256.layer`), and a block's norm weights and conv
biases onto rows of its vector parameters (`...res.w256.1.vectors.3`). That map depends on the
config: the rules are generated per config by `weight_rules(cfg)`.
"""

from __future__ import annotations

import re
from pathlib import Path

from flax import nnx
from jax.sharding import Mesh

from jaxsync.models.chameleon._config import ChameleonConfig, ChameleonVQConfig
from jaxsync.models.chameleon._layout import block_rows, encoder_layout
from jaxsync.models.chameleon._modules import ChameleonImageTower
from jaxsync.weights import PartitionRules, Rule, checkpoint_dtype, conv, load_weights


PREFIX = "model."
# post_quant_conv belongs to the image *decoder* path: present in checkpoints, unused here.
SELECT = r"model\.(?:vqmodel\.(?!post_quant_conv\.)|embed_tokens\.weight$)"

_NORMS = "norm|norm1|norm2|norm_out"
_CONVS = "conv_in|conv_out|conv1|conv2|conv|nin_shortcut|q|k|v|proj_out|quant_conv"
# torch Conv2d [O, I, kh, kw] -> nnx.Conv [kh, kw, I, O]
_KERNEL = (rf"({_CONVS})\.weight", r"\1.kernel", conv(2))
_LEAVES = (
    # torch GroupNorm (weight, bias) -> nnx.GroupNorm (scale, bias)
    (rf"({_NORMS})\.weight", r"\1.scale", None),
    (rf"({_NORMS})\.bias", r"\1.bias", None),
    _KERNEL,
    (rf"({_CONVS})\.bias", r"\1.bias", None),
)


def weight_rules(cfg: ChameleonConfig | ChameleonVQConfig) -> tuple[Rule, ...]:
    """HF key (after `model.`) -> `ChameleonImageTower` parameter path, for this config.

    Every encoder block's key prefix maps to its stack slice; its conv kernels map one to one
    below it, and its norm weights and conv biases onto rows of its vector parameters
    (`_layout.block_rows`: `down.0.block.1.norm2.bias` -> `res.w128.1.vectors.4`, row 4 of
    layer 1 of `res.w128.layer.vectors`).
    """
    vq = cfg.vq if isinstance(cfg, ChameleonConfig) else cfg
    layout = encoder_layout(vq)
    # Prefixes hold no group: the leaf patterns' group is the rules' `\1`.
    rules = [
        Rule(src + pattern, dst + target, transform)
        for src, dst in ((r"vqmodel\.encoder\.", "vqmodel.encoder."), (r"vqmodel\.", "vqmodel."))
        for pattern, target, transform in _LEAVES
    ]
    for block, slot in layout.slots.items():
        src, dst = rf"vqmodel\.encoder\.{re.escape(block)}\.", f"vqmodel.encoder.{slot.path}."
        _, cin, cout = layout.stacks[slot.group][slot.key]
        rows = block_rows(slot.group, cin, cout)
        for leaf, (param, row) in rows.items():
            rules.append(Rule(src + re.escape(leaf), f"{dst}{param}.{row}"))
        leaves = (_KERNEL,) if rows else _LEAVES  # the rows take the norms and biases
        rules.extend(Rule(src + pattern, dst + target, f) for pattern, target, f in leaves)
    rules.append(Rule(r"vqmodel\.quantize\.embedding\.weight", "vqmodel.quantize.embedding"))
    rules.append(Rule(r"embed_tokens\.weight", "embed_tokens.embedding"))  # [V, D], same layout
    return tuple(rules)


PARTITION_RULES: PartitionRules = (
    # The text embedding splits its vocabulary rows, as vLLM's VocabParallelEmbedding: each
    # device gathers the ids it holds and one all-reduce sums the rows; the table never moves.
    (r"^embed_tokens\.embedding$", ("model", None)),
)
"""NNX parameter path regex -> mesh axes (a dimension the axis does not divide is replicated).

The VQ-VAE encoder is data parallel: its conv kernels, GroupNorms, attention and codebook stay
replicated, and a batch split over a "data" axis runs with no collective. A split of conv
output channels would not pay: every following conv reads all input channels and every
GroupNorm all channels of its group, so each layer would gather its activations (and the
encoder's weights are small next to its activations). The text embedding is vocabulary
parallel.

Collectives of one forward on a `("data", "model")` mesh (inputs replicated, or split over
"data" with the rows asked split the same way):

| where                               | all-reduce                              | all-gather |
| ----------------------------------- | --------------------------------------- | ---------- |
| each encoder block (the scans)      | 0                                       | 0          |
| token embedding (vocabulary split)  | 1 where "model" divides the vocabulary  | 0          |
| whole forward (HLO op count)        | at most 1                               | 0          |
"""


def load_model(
    checkpoint: str | Path,
    cfg: ChameleonConfig | None = None,
    *,
    dtype=None,
    mesh: Mesh | None = None,
    partition_rules: PartitionRules = PARTITION_RULES,
) -> ChameleonImageTower:
    """Loads the image tower of a Chameleon checkpoint: the VQ-VAE tokenizer and the text
    token embedding.

    Args:
      checkpoint: a directory (with `config.json` when `cfg` is None), a `.safetensors` file or
        a sharded index.
      cfg: the config; None reads `from_hf_config(checkpoint)`.
      dtype: None keeps the checkpoint's float dtype (a bf16 checkpoint loads at bf16, the
        computation dtype follows); an explicit dtype casts every float tensor to it.
      mesh: places each parameter as it is read, per `partition_rules` (replicated otherwise).
      partition_rules: `[(regex over the parameter path, axes), ...]`.

    Raises:
      TypeError: a `cfg` that is not a `ChameleonConfig`.
      jaxsync.weights.WeightError: a missing, unknown or mis-shaped tower tensor, or checkpoint
        float tensors of mixed dtypes with `dtype=None`.
    """
    if cfg is None:
        cfg = ChameleonConfig.from_hf_config(checkpoint)
    if not isinstance(cfg, ChameleonConfig):
        raise TypeError(f"cfg must be a ChameleonConfig, got {type(cfg).__name__}")
    if dtype is None:
        dtype = checkpoint_dtype(checkpoint, select=SELECT)
    return load_weights(
        lambda: ChameleonImageTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype),
        checkpoint,
        weight_rules(cfg),
        select=SELECT,
        strip=PREFIX,
        dtype=dtype,
        mesh=mesh,
        partition_rules=partition_rules,
    )
