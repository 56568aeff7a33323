"""Checkpoint mapping for the Gemma 3n audio path (`model.audio_tower.*`, `model.embed_audio.*`).

NNX attribute names mirror transformers' module names, so most rules only rename `weight` to the
NNX parameter name and fix the layout. Rules are tried in order; the first match wins.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.models.gemma3n._config import Gemma3nAudioConfig, from_hf_config
from jaxsync.models.gemma3n._modules import Gemma3nAudioModel
from jaxsync.weights import Rule, checkpoint_dtype, conv, linear, load_weights


__all__ = ["AUDIO_RULES", "PARTITION_RULES", "load_model"]

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


# NNX parameter path -> mesh axes for tensor-parallel placement over a "model" axis: the widening
# projections split their output columns, the narrowing ones their input rows. Axes a mesh lacks
# are ignored and a dimension they do not divide stays replicated (`jaxsync.weights`).
PARTITION_RULES = (
    (r"ffw_layer_1\.kernel$", (None, "model")),
    (r"ffw_layer_2\.kernel$", ("model", None)),
    (r"attn\.(q_proj|k_proj|v_proj)\.kernel$", (None, "model")),
    (r"attention\.post\.kernel$", ("model", None)),
    (r"lconv1d\.linear_start\.kernel$", (None, "model")),
    (r"lconv1d\.linear_end\.kernel$", ("model", None)),
    (r"embed_audio\.embedding_projection\.kernel$", (None, "model")),
)

_STRIP = "model."
_SELECT = r"^model\.(audio_tower|embed_audio)\."


def load_model(
    checkpoint: str | Path,
    cfg: Gemma3nAudioConfig | None = None,
    *,
    dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    partition_rules=PARTITION_RULES,
) -> Gemma3nAudioModel:
    """Loads the audio tower and embedder from a Gemma 3n checkpoint (`model.audio_tower.*`,
    `model.embed_audio.*` of `Gemma3nForConditionalGeneration` / `Gemma3nModel`).

    Args:
        checkpoint: safetensors file, sharded index or directory.
        cfg: the audio path config; None reads `config.json` next to the checkpoint.
        dtype: None keeps the checkpoint's float dtype (a bf16 checkpoint loads at bf16); a
            float dtype casts every parameter and computes in it.
        mesh: places each parameter on this mesh as it is read (`partition_rules`; parameters
            no rule matches are replicated). None: the default device.
        partition_rules: `[(regex over the NNX path, mesh axes), ...]`.

    Raises:
        jaxsync.weights.WeightError: a missing, unexpected or misshapen tensor, or mixed dtypes.
        ValueError / TypeError: an unsupported or malformed config.
    """
    if cfg is None:
        cfg = from_hf_config(checkpoint)  # the config.json beside the checkpoint
    if not isinstance(cfg, Gemma3nAudioConfig):
        raise TypeError(f"cfg must be a Gemma3nAudioConfig, got {type(cfg).__name__}")
    dt = checkpoint_dtype(checkpoint, _SELECT, _STRIP) if dtype is None else jnp.dtype(dtype)
    return load_weights(
        lambda: Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt),
        checkpoint,
        AUDIO_RULES,
        select=_SELECT,
        strip=_STRIP,
        dtype=dtype,
        mesh=mesh,
        partition_rules=partition_rules if mesh is not None else None,
    )
