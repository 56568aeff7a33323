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
from jaxsync.weights import Rule, Transform, checkpoint_dtype, conv, linear, load_weights


__all__ = ["AUDIO_RULES", "PARTITION_RULES", "load_model"]


def _glu_pairs(w):
    """`linear_start` [2D, D] (the GLU's value rows, then its gate rows) -> kernel [D, 2D]
    with channel c's value and gate in columns 2c and 2c + 1.

    In this order a split of the columns over a "model" axis of a size dividing D keeps each
    channel's value and gate on one device, so the GLU (`ConformerLightConv1d`, which reads the
    pairs) and the depthwise conv after it run on local channels with no exchange.
    """
    two_d, d = w.shape
    return w.reshape(2, two_d // 2, d).transpose(2, 1, 0).reshape(d, two_d)


def _glu_stored(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != 2 or shape[1] != 2 * shape[0]:
        raise ValueError(f"glu_pairs maps onto [D, 2D], not {shape}")
    return (shape[1], shape[0])


GLU_PAIRS = Transform(_glu_pairs, _glu_stored, "glu_pairs")

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
    Rule(
        r"audio_tower\.conformer\.(\d+)\.lconv1d\.linear_start\.weight",
        r"audio_tower.conformer.\1.lconv1d.linear_start.kernel",
        GLU_PAIRS,
    ),
    # Every other weight is a bias-free nn.Linear [out, in] -> [in, out].
    Rule(r"(.*)\.weight", r"\1.kernel", linear),
)


PARTITION_RULES = (
    (r"ffw_layer_1\.kernel$", (None, "model")),
    (r"ffw_layer_2\.kernel$", ("model", None)),
    (r"attn\.(q_proj|k_proj|v_proj)\.kernel$", (None, "model")),
    (r"attention\.post\.kernel$", ("model", None)),
    (r"lconv1d\.linear_start\.kernel$", (None, "model")),
    (r"lconv1d\.linear_end\.kernel$", ("model", None)),
)
"""Megatron-style tensor parallelism over a "model" mesh axis (NNX path -> mesh axes).

The widening projections split their output columns (the FFW's `ffw_layer_1`; q, k, v, whose
columns are heads major as the attention reshapes them; `linear_start`, loaded with each
channel's GLU value and gate side by side, see `GLU_PAIRS`), the narrowing ones their input
rows (`ffw_layer_2`, `attention.post`, `linear_end`), so each sub-block ends in one all-reduce.
Between `linear_start` and `linear_end` the light conv stays on local channels: the depthwise
conv kernel is replicated (each device reads its channels' taps) and `conv_norm`, an RMSNorm
over the split channels, all-reduces its per-row sum of squares (`[B, T]`, not the rows). The
embedder (one `[D_a, D]` projection per forward, not per layer) stays replicated: a column split
would leave the rows split over "model" (gathered for the server), and a row split pulls the
conformer's residual stream onto split features (a gather before every widening projection).
The subsampling convs, the norms and the relative position projection stay replicated. Axes a
mesh lacks are ignored and a dimension they do not divide stays replicated (`hidden_size`,
`conf_num_attention_heads` and the FFW width must divide by the "model" size for a full split).

Collectives of one forward on a `("data", "model")` mesh (inputs replicated):

| where                             | all-reduce                                         | gather |
| --------------------------------- | -------------------------------------------------- | ------ |
| each conformer layer (scan body)  | 5: two FFWs, `attention.post`, `linear_end`, and   | 0      |
|                                   | `conv_norm`'s `[B, T]` sum of squares              |        |
| subsampling convs, embedder       | 0                                                  | 0      |
| whole forward (HLO op count)      | 5 at any depth                                     | 0      |
"""

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
