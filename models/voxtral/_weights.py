"""Checkpoint key table (transformers / Hub Voxtral keys -> `VoxtralAudioTower`), sharding rules,
and `load_model`.

Hub checkpoints (Voxtral-Mini-3B-2507, -Small-24B-2507) store `audio_tower.*` and
`multi_modal_projector.*` at the top level; transformers 5.x renames them on load to
`model.audio_tower.*` / `model.multi_modal_projector.*` (conversion_mapping "qwen2_audio"), which is
what `state_dict()` of a 5.x `VoxtralForConditionalGeneration` shows. Both spellings load.
Language-model keys are not selected (nor their shards read, given an index).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from jaxsync.models.voxtral._config import VoxtralAudioConfig
from jaxsync.models.voxtral._modules import VoxtralAudioTower
from jaxsync.weights import PartitionRules, Rule, checkpoint_dtype, conv, linear, load_weights


_P = r"(?:model\.)?"  # optional transformers-5.x prefix
_A = _P + r"audio_tower\."
_L = _A + r"layers\.(\d+)\."

SELECT = _P + r"(?:audio_tower|multi_modal_projector)\."

RULES: tuple[Rule, ...] = (
    Rule(_A + r"conv([12])\.weight", r"conv\1.kernel", conv(1)),
    Rule(_A + r"conv([12])\.bias", r"conv\1.bias"),
    Rule(_A + r"embed_positions\.weight", "embed_positions.embedding"),
    Rule(
        _L + r"self_attn\.([qkv]|out)_proj\.weight", r"layers.\1.self_attn.\2_proj.kernel", linear
    ),
    Rule(_L + r"self_attn\.(q|v|out)_proj\.bias", r"layers.\1.self_attn.\2_proj.bias"),
    Rule(_L + r"fc([12])\.weight", r"layers.\1.fc\2.kernel", linear),
    Rule(_L + r"fc([12])\.bias", r"layers.\1.fc\2.bias"),
    Rule(_L + r"(self_attn_layer_norm|final_layer_norm)\.weight", r"layers.\1.\2.scale"),
    Rule(_L + r"(self_attn_layer_norm|final_layer_norm)\.bias", r"layers.\1.\2.bias"),
    Rule(_A + r"layer_norm\.weight", "layer_norm.scale"),
    Rule(_A + r"layer_norm\.bias", "layer_norm.bias"),
    Rule(
        _P + r"multi_modal_projector\.linear_([12])\.weight",
        r"multi_modal_projector.linear_\1.kernel",
        linear,
    ),  # fmt: skip
)

# Megatron-style tensor parallelism over a "model" mesh axis: heads and MLP columns split on the
# way in, rows on the way out (one all-reduce per block); everything else replicated. Axes a mesh
# lacks, or that do not divide a dimension, are dropped (`jaxsync.weights.partition_spec`). The
# layers are one `jaxsync.LayerStack` (parameters `layers.layer.*`, `[L, ...]`): their axes
# describe one layer, and the loader keeps the layer axis whole.
_S = r"layers\.layer\."
PARTITION_RULES: PartitionRules = (
    (_S + r"self_attn\.(q|k|v)_proj\.kernel", (None, "model")),
    (_S + r"self_attn\.(q|v)_proj\.bias", ("model",)),
    (_S + r"self_attn\.out_proj\.kernel", ("model", None)),
    (_S + r"fc1\.kernel", (None, "model")),
    (_S + r"fc1\.bias", ("model",)),
    (_S + r"fc2\.kernel", ("model", None)),
    (r"multi_modal_projector\.linear_1\.kernel", (None, "model")),
    (r"multi_modal_projector\.linear_2\.kernel", ("model", None)),
)
"""Megatron-style tensor parallelism over a "model" mesh axis.

q, k, v (`[D, N*H]`, heads major, as the attention reshapes them to `[..., N, H]`), fc1 and the
projector's `linear_1` are split by output column; out_proj, fc2 and `linear_2` by input row,
so attention, MLP and projector each end in one all-reduce. The two stem convs, the norms and
the position table stay replicated. `num_attention_heads`, `intermediate_size` and the text
width must divide by the "model" size for a full split (otherwise that weight is replicated).

Collectives of one forward on a `("data", "model")` mesh (inputs replicated):

| where                          | all-reduce                    | all-gather |
| ------------------------------ | ----------------------------- | ---------- |
| each layer (the scan's body)   | 2: after `out_proj`, `fc2`    | 0          |
| projector                      | 1: after `linear_2`           | 0          |
| conv stem                      | 0                             | 0          |
| whole forward (HLO op count)   | 3 at any depth (2 unprojected)| 0          |
"""


def load_model(
    checkpoint: str | Path,
    cfg: VoxtralAudioConfig | None = None,
    *,
    dtype: Any = None,
    mesh: Any = None,
    partition_rules: PartitionRules = PARTITION_RULES,
) -> VoxtralAudioTower:
    """Loads the audio tower and projector of a Voxtral checkpoint (file, index or directory).

    Args:
      checkpoint: safetensors file, sharded index, or directory.
      cfg: the audio config; None reads `from_hf_config(checkpoint)` (a directory's
        `config.json`, or the one next to a file).
      dtype: None keeps the checkpoint's float dtype (a bf16 checkpoint loads at bf16); a dtype
        casts to it. `embed_positions` stays float32 either way, as transformers keeps it.
      mesh: place each parameter on this mesh as it is read, per `partition_rules`.
      partition_rules: `[(regex over parameter paths, axes), ...]` (default `PARTITION_RULES`).

    Raises:
      jaxsync.weights.WeightError: unknown, missing, mis-shaped or mis-typed tensors, or an
        unreadable file.
    """
    if cfg is None:
        path = Path(checkpoint)
        cfg = VoxtralAudioConfig.from_hf_config(path if path.is_dir() else path.parent)
    if not isinstance(cfg, VoxtralAudioConfig):
        raise TypeError(f"cfg must be a VoxtralAudioConfig or None, got {type(cfg).__name__}")
    if dtype is None:
        dtype = checkpoint_dtype(checkpoint, select=SELECT)

    def factory() -> VoxtralAudioTower:
        return VoxtralAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)

    # Every float tensor goes to its parameter's declared dtype: `dtype` for all but the
    # float32 position table.
    return load_weights(
        factory, checkpoint, RULES, select=SELECT, allow_cast=True, mesh=mesh,
        partition_rules=partition_rules if mesh is not None else None,
    )  # fmt: skip
