"""Checkpoint mapping for the Chameleon VQ-VAE tokenizer (`model.vqmodel.*` keys) and its loader."""

from __future__ import annotations

from pathlib import Path

from flax import nnx
from jax.sharding import Mesh

from jaxsync.models.chameleon._config import ChameleonConfig, ChameleonVQConfig
from jaxsync.models.chameleon._modules import ChameleonVQVAE
from jaxsync.weights import PartitionRules, Rule, checkpoint_dtype, conv, load_weights


VQ_PREFIX = "model.vqmodel."
# post_quant_conv belongs to the image *decoder* path: present in checkpoints, unused here.
VQ_SELECT = r"model\.vqmodel\.(?!post_quant_conv\.)"

_NORM = r"((?:.+\.)?(?:norm|norm1|norm2|norm_out))"
_CONV = r"((?:.+\.)?(?:conv_in|conv_out|conv1|conv2|conv|nin_shortcut|q|k|v|proj_out|quant_conv))"

VQ_RULES = (
    # torch GroupNorm (weight, bias) -> nnx.GroupNorm (scale, bias)
    Rule(_NORM + r"\.weight", r"\1.scale"),
    Rule(_NORM + r"\.bias", r"\1.bias"),
    # torch Conv2d [O, I, kh, kw] -> nnx.Conv [kh, kw, I, O]
    Rule(_CONV + r"\.weight", r"\1.kernel", conv(2)),
    Rule(_CONV + r"\.bias", r"\1.bias"),
    # nn.Embedding [num_embeddings, embed_dim], same layout
    Rule(r"quantize\.embedding\.weight", "quantize.embedding"),
)
"""HF key (after stripping `model.vqmodel.`) -> `ChameleonVQVAE` parameter path."""

PARTITION_RULES: PartitionRules = (
    # Conv kernels [kh, kw, I, O] and their biases split over output channels; GroupNorm
    # parameters and the codebook stay replicated (a norm needs every channel of its group).
    (
        r"(conv_in|conv_out|conv1|conv2|conv|nin_shortcut|q|k|v|proj_out|quant_conv)\.kernel",
        (None, None, None, "model"),
    ),
    (
        r"(conv_in|conv_out|conv1|conv2|conv|nin_shortcut|q|k|v|proj_out|quant_conv)\.bias",
        ("model",),
    ),
)
"""NNX parameter path regex -> mesh axes (a dimension the axis does not divide is replicated)."""


def load_model(
    checkpoint: str | Path,
    cfg: ChameleonConfig | ChameleonVQConfig | None = None,
    *,
    dtype=None,
    mesh: Mesh | None = None,
    partition_rules: PartitionRules = PARTITION_RULES,
) -> ChameleonVQVAE:
    """Loads the VQ-VAE image tokenizer of a Chameleon checkpoint.

    Args:
      checkpoint: a directory (with `config.json` when `cfg` is None), a `.safetensors` file or
        a sharded index.
      cfg: the config (`ChameleonConfig` or its `.vq`); None reads `from_hf_config(checkpoint)`.
      dtype: None keeps the checkpoint's float dtype (a bf16 checkpoint loads at bf16, the
        computation dtype follows); an explicit dtype casts every float tensor to it.
      mesh: places each parameter as it is read, per `partition_rules` (replicated otherwise).
      partition_rules: `[(regex over the parameter path, axes), ...]`.

    Raises:
      jaxsync.weights.WeightError: a missing, unknown or mis-shaped `model.vqmodel.*` tensor, or
        checkpoint float tensors of mixed dtypes with `dtype=None`.
    """
    if cfg is None:
        cfg = ChameleonConfig.from_hf_config(checkpoint)
    vq = cfg.vq if isinstance(cfg, ChameleonConfig) else cfg
    if not isinstance(vq, ChameleonVQConfig):
        raise TypeError(f"cfg must be a ChameleonConfig or ChameleonVQConfig, got {type(cfg)}")
    if dtype is None:
        dtype = checkpoint_dtype(checkpoint, select=VQ_SELECT)
    return load_weights(
        lambda: ChameleonVQVAE(vq, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype),
        checkpoint,
        VQ_RULES,
        select=VQ_SELECT,
        strip=VQ_PREFIX,
        dtype=dtype,
        mesh=mesh,
        partition_rules=partition_rules,
    )
