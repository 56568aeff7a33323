"""Checkpoint key table: transformers / Hub Voxtral keys -> `VoxtralAudioModel` parameters.

Hub checkpoints (Voxtral-Mini-3B-2507, -Small-24B-2507) store `audio_tower.*` and
`multi_modal_projector.*` at the top level; transformers 5.x renames them on load to
`model.audio_tower.*` / `model.multi_modal_projector.*` (conversion_mapping "qwen2_audio"), which is
what `state_dict()` of a 5.x `VoxtralForConditionalGeneration` shows. Both spellings load.
Language-model keys are not selected.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from jaxsync.models.voxtral._config import VoxtralAudioConfig
from jaxsync.models.voxtral._model import VoxtralAudioModel
from jaxsync.weights import Rule, conv, linear, load_weights


_P = r"(?:model\.)?"  # optional transformers-5.x prefix
_A = _P + r"audio_tower\."
_L = _A + r"layers\.(\d+)\."

SELECT = _P + r"(?:audio_tower|multi_modal_projector)\."

RULES: tuple[Rule, ...] = (
    Rule(_A + r"conv([12])\.weight", r"audio_tower.conv\1.kernel", conv(1)),
    Rule(_A + r"conv([12])\.bias", r"audio_tower.conv\1.bias"),
    Rule(_A + r"embed_positions\.weight", "audio_tower.embed_positions.embedding"),
    Rule(
        _L + r"self_attn\.([qkv]|out)_proj\.weight",
        r"audio_tower.layers.\1.self_attn.\2_proj.kernel",
        linear,
    ),  # fmt: skip
    Rule(_L + r"self_attn\.(q|v|out)_proj\.bias", r"audio_tower.layers.\1.self_attn.\2_proj.bias"),
    Rule(_L + r"fc([12])\.weight", r"audio_tower.layers.\1.fc\2.kernel", linear),
    Rule(_L + r"fc([12])\.bias", r"audio_tower.layers.\1.fc\2.bias"),
    Rule(
        _L + r"(self_attn_layer_norm|final_layer_norm)\.weight", r"audio_tower.layers.\1.\2.scale"
    ),
    Rule(_L + r"(self_attn_layer_norm|final_layer_norm)\.bias", r"audio_tower.layers.\1.\2.bias"),
    Rule(_A + r"layer_norm\.weight", "audio_tower.layer_norm.scale"),
    Rule(_A + r"layer_norm\.bias", "audio_tower.layer_norm.bias"),
    Rule(
        _P + r"multi_modal_projector\.linear_([12])\.weight",
        r"multi_modal_projector.linear_\1.kernel",
        linear,
    ),  # fmt: skip
)


def load_voxtral_audio(
    checkpoint: str | Path,
    config: VoxtralAudioConfig,
    *,
    dtype=jnp.float32,
    allow_cast: bool = False,
    sharding=None,
) -> VoxtralAudioModel:
    """Loads the audio tower and projector of a Voxtral checkpoint (file, index or directory).

    Args:
      checkpoint: safetensors file, sharded index, or directory.
      config: the audio config (see `VoxtralAudioConfig.from_hf_config`).
      dtype: compute and parameter dtype (embed_positions stays float32, as upstream).
      allow_cast: allow float casts, e.g. an fp32 checkpoint into a bf16 model.
      sharding: optional per-parameter placement, forwarded to `jaxsync.weights.load_weights`.

    Raises:
      jaxsync.weights.WeightError: unknown, missing, mis-shaped or mis-typed tensors.
    """

    def factory() -> VoxtralAudioModel:
        return VoxtralAudioModel(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)

    return load_weights(
        factory, checkpoint, RULES, select=SELECT, allow_cast=allow_cast, sharding=sharding
    )
