"""Checkpoint mapping for the Gemma 3n audio path (`model.audio_tower.*`, `model.embed_audio.*`).

NNX attribute names mirror transformers' module names, so most rules only rename `weight` to the
NNX parameter name and fix the layout. Rules are tried in order; the first match wins.
"""

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._model import Gemma3nAudioModel
from jaxsync.weights import Rule, conv, linear, load_weights


__all__ = ["AUDIO_RULES", "AUDIO_SELECT", "load_audio_model"]

# Keys of Gemma3nForConditionalGeneration / Gemma3nModel checkpoints owned by this path.
AUDIO_SELECT = r"model\.(audio_tower|embed_audio)\."

AUDIO_RULES = (
    # Conv2d [O, I, kT, kF] -> nnx.Conv [kT, kF, I, O].
    Rule(
        r"audio_tower\.subsample_conv_projection\.conv_(\d)\.conv\.weight",
        r"audio_tower.subsample_conv_projection.conv_\1.conv.kernel",
        conv(2),
    ),
    # Depthwise Conv1d [D, 1, K] -> nnx.Conv [K, 1, D] (feature_group_count = D).
    Rule(
        r"audio_tower\.conformer\.(\d+)\.lconv1d\.depthwise_conv1d\.weight",
        r"audio_tower.conformer.\1.lconv1d.depthwise_conv1d.kernel",
        conv(1),
    ),
    # RMSNorm / cumulative group norm scales and the per-dim query scale: same layout.
    Rule(r"(.*_norm|.*\.norm)\.weight", r"\1.weight"),
    Rule(r"(.*)\.per_dim_scale", r"\1.per_dim_scale"),
    Rule(r"embed_audio\.embedding\.weight", r"embed_audio.embedding.embedding"),
    # Every other weight is a bias-free nn.Linear [out, in] -> [in, out].
    Rule(r"(.*)\.weight", r"\1.kernel", linear),
)


def load_audio_model(
    cfg: Gemma3nAudioConfig,
    checkpoint: str | Path,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    strip: str = "model.",
) -> Gemma3nAudioModel:
    """Loads the audio tower and embedder from an HF Gemma 3n checkpoint.

    Args:
        cfg: the audio path config (e.g. `Gemma3nAudioConfig.from_hf_config(hf_cfg)`).
        checkpoint: safetensors file, sharded index or directory.
        dtype: computation dtype.
        param_dtype: parameter dtype (default `dtype`); float checkpoints are cast.
        strip: key prefix before `audio_tower.` / `embed_audio.` (`"model."` for
            Gemma3nForConditionalGeneration and Gemma3nModel checkpoints).
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    select = "^" + strip.replace(".", r"\.") + r"(audio_tower|embed_audio)\."
    return load_weights(
        lambda: Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype),
        checkpoint,
        AUDIO_RULES,
        select=select,
        strip=strip,
        allow_cast=True,
    )
