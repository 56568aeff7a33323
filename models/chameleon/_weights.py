"""Checkpoint mapping for the Chameleon VQ-VAE tokenizer (`model.vqmodel.*` keys)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from jaxsync.models.chameleon._config import ChameleonVQConfig
from jaxsync.models.chameleon._vqvae import ChameleonVQVAE
from jaxsync.weights import Rule, conv, load_weights


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


def load_vqvae(
    cfg: ChameleonVQConfig,
    checkpoint: str | Path,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    allow_cast: bool = True,
) -> ChameleonVQVAE:
    """Loads the VQ-VAE tokenizer from a Chameleon checkpoint.

    Args:
      cfg: the VQ config (`ChameleonConfig.vq`).
      checkpoint: a `.safetensors` file, a sharded index, or a directory holding either.
      dtype: computation dtype (bf16 for the released model).
      param_dtype: parameter dtype; defaults to `dtype`.
      allow_cast: convert float checkpoint tensors to `param_dtype` (e.g. fp32 file -> bf16).

    Raises:
      jaxsync.weights.WeightError: a missing, unknown or mis-shaped `model.vqmodel.*` tensor.
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    return load_weights(
        lambda: ChameleonVQVAE(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype),
        checkpoint,
        VQ_RULES,
        select=VQ_SELECT,
        strip=VQ_PREFIX,
        allow_cast=allow_cast,
    )
