"""Checkpoint mapping for the Qwen3-Omni audio encoder (`thinker.audio_tower.*` keys).

Released checkpoints (and HF 5.x `save_pretrained`, which reverses its load-time renames) store the
encoder under `thinker.audio_tower.`; HF 5.x holds it in memory as `thinker.model.audio_tower.`
(a raw `state_dict()` of `Qwen3OmniMoeForConditionalGeneration`), a thinker alone drops `thinker.`,
and a standalone `Qwen3OmniMoeAudioEncoder` has no prefix. `find_prefix` detects which one a
checkpoint uses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.models.qwen3_omni._config import Qwen3OmniAudioConfig
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower
from jaxsync.weights import (
    PartitionRules,
    Rule,
    WeightError,
    checkpoint_dtype,
    checkpoint_keys,
    compose,
    linear,
    load_weights,
    reshape as reshape_to,
    transpose as transpose_axes,
)


PREFIXES = (
    "thinker.audio_tower.",
    "thinker.model.audio_tower.",
    "audio_tower.",
    "model.audio_tower.",
    "",
)
"""Prefixes under which the encoder is found, most specific first."""
_PREFIX_RE = re.compile(r"((?:thinker\.)?(?:model\.)?audio_tower\.)?conv2d1\.weight")

# torch Conv2d [O, I, kh=mel, kw=time] -> nnx.Conv [k_time, k_mel, I, O]: our conv runs time-major.
_CONV_TIME_MAJOR = transpose_axes(3, 2, 1, 0)


def audio_rules(cfg: Qwen3OmniAudioConfig) -> tuple[Rule, ...]:
    """HF key (prefix stripped) -> `Qwen3OmniAudioTower` parameter path."""
    conv_out = (cfg.downsample_hidden_size, cfg.conv_freq_bins, cfg.d_model)
    lin = r"((?:layers\.\d+\.self_attn\.(?:q|k|v|out)_proj)|(?:layers\.\d+\.fc[12])|proj[12])"
    norm = r"((?:layers\.\d+\.(?:self_attn_layer_norm|final_layer_norm))|ln_post)"
    return (
        Rule(r"(conv2d[123])\.weight", r"\1.kernel", _CONV_TIME_MAJOR),
        Rule(r"(conv2d[123])\.bias", r"\1.bias"),
        # [D, C * F] with torch's (channel, freq) flattening -> [C, F, D]; the stored layout is
        # checked before the reshape (a transposed [C * F, D] has the same element count).
        Rule(
            r"conv_out\.weight",
            "conv_out.kernel",
            compose(linear, reshape_to(*conv_out, stored=(conv_out[0] * conv_out[1], conv_out[2]))),
        ),
        Rule(lin + r"\.weight", r"\1.kernel", linear),
        Rule(lin + r"\.bias", r"\1.bias"),
        Rule(norm + r"\.weight", r"\1.scale"),
        Rule(norm + r"\.bias", r"\1.bias"),
    )


def find_prefix(checkpoint: str | Path) -> str:
    """The key prefix of the audio encoder in `checkpoint` (key names only: from a sharded
    checkpoint's index, else from the file headers).

    Raises:
      WeightError: no `conv2d1.weight` under a known prefix, or more than one; an unreadable
        index or file.
    """
    found = set()
    for key in checkpoint_keys(checkpoint):
        m = _PREFIX_RE.fullmatch(key)
        if m:
            found.add(m.group(1) or "")
    if len(found) != 1:
        raise WeightError(
            f"expected one audio encoder in {checkpoint} under one of {PREFIXES}; "
            f"found conv2d1.weight under {sorted(found) or 'none'}"
        )
    return found.pop()


PARTITION_RULES: PartitionRules = (
    # Megatron-style: q/k/v and fc1 split their outputs over "model", out_proj and fc2 their
    # inputs, so each layer needs one all-reduce after attention and one after the MLP.
    (r"layers\.layer\.self_attn\.(q|k|v)_proj\.kernel", (None, "model")),
    (r"layers\.layer\.self_attn\.(q|k|v)_proj\.bias", ("model",)),
    (r"layers\.layer\.fc1\.kernel", (None, "model")),
    (r"layers\.layer\.fc1\.bias", ("model",)),
    (r"layers\.layer\.self_attn\.out_proj\.kernel", ("model", None)),
    (r"layers\.layer\.fc2\.kernel", ("model", None)),
)
"""Megatron-style tensor parallelism over a "model" mesh axis.

q, k, v (`[D, N*H]`, heads major, as the attention reshapes them to `[..., N, H]`) and fc1 are
split by output column, so each device holds whole heads and a slice of the MLP; out_proj and
fc2 are split by input row, so attention and MLP each end in one all-reduce of `[W, Q, D]`
partial sums. The conv stem, `conv_out`, the norms and the output head (`proj1`, `proj2`) stay
replicated. Axes describe one layer of the stacked `layers.layer.*` parameters (the layer axis
stays unsharded); `encoder_attention_heads` and `encoder_ffn_dim` must divide by the "model"
size for a full split (otherwise that weight is replicated).

Collectives of one forward on a `("data", "model")` mesh (inputs replicated):

| where                          | all-reduce                     | all-gather |
| ------------------------------ | ------------------------------ | ---------- |
| each layer (the scan's body)   | 2: after `out_proj`, `fc2`     | 0          |
| conv stem, head                | 0                              | 0          |
| whole forward (HLO op count)   | 2 at any depth                 | 0          |
"""
"""Parameter path regex -> mesh axes (`jaxsync.weights.load_weights`); the rest is replicated.
The paths are the stacked parameters' (`layers.layer.fc1.kernel`, `[L, ...]`) and the axes
describe one layer: the loader keeps the layer axis unsharded in front. Axes the mesh lacks, or a
"model" axis that does not divide a dimension, leave it replicated."""


def load_model(
    checkpoint: str | Path,
    cfg: Qwen3OmniAudioConfig | None = None,
    *,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    partition_rules: PartitionRules = PARTITION_RULES,
) -> Qwen3OmniAudioTower:
    """Loads the audio encoder from a Qwen3-Omni (or standalone encoder) checkpoint.

    Args:
      checkpoint: a `.safetensors` file, a sharded index, or a directory holding either (and,
        for `cfg=None`, its `config.json`). The key prefix is detected (`PREFIXES`).
      cfg: the encoder config; None reads it with `Qwen3OmniAudioConfig.from_hf_config`.
      dtype: None keeps the checkpoint's float dtype (a bf16 checkpoint loads at bf16); a
        float dtype casts every weight to it and computes in it.
      mesh: places each parameter as it is read, by `partition_rules` (unmatched: replicated).
      partition_rules: `[(regex, axes), ...]` over the tower's parameter paths.

    Raises:
      jaxsync.weights.WeightError: a missing, unknown, mis-shaped or unreadable encoder tensor.
      ValueError / TypeError: an invalid or unsupported config.
    """
    if cfg is None:
        cfg = Qwen3OmniAudioConfig.from_hf_config(checkpoint)  # reads the config.json beside it
    elif not isinstance(cfg, Qwen3OmniAudioConfig):
        raise TypeError(f"cfg must be a Qwen3OmniAudioConfig or None, got {type(cfg).__name__}")
    prefix = find_prefix(checkpoint)
    # The position table is a non-persistent buffer, derived from the config; tolerate it.
    select = "^" + re.escape(prefix) + r"(?!positional_embedding\.)"
    if dtype is None:
        dtype = checkpoint_dtype(checkpoint, select=select, strip=prefix)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a float dtype, got {dtype}")
    return load_weights(
        lambda: Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype),
        checkpoint,
        audio_rules(cfg),
        select=select,
        strip=prefix,
        dtype=dtype,
        mesh=mesh,
        partition_rules=partition_rules if mesh is not None else None,
    )
