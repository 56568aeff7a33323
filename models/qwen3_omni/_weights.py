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

import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from jaxsync.models.qwen3_omni._config import Qwen3OmniAudioConfig
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower
from jaxsync.weights import (
    Rule,
    WeightError,
    checkpoint_files,
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
        # [D, C * F] with torch's (channel, freq) flattening -> [C, F, D]
        Rule(r"conv_out\.weight", "conv_out.kernel", compose(linear, reshape_to(*conv_out))),
        Rule(lin + r"\.weight", r"\1.kernel", linear),
        Rule(lin + r"\.bias", r"\1.bias"),
        Rule(norm + r"\.weight", r"\1.scale"),
        Rule(norm + r"\.bias", r"\1.bias"),
    )


def find_prefix(checkpoint: str | Path) -> str:
    """The key prefix of the audio encoder in `checkpoint` (reads key names only).

    Raises:
      WeightError: no `conv2d1.weight` under a known prefix, or more than one.
    """
    found = set()
    for file in checkpoint_files(checkpoint):
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                m = _PREFIX_RE.fullmatch(key)
                if m:
                    found.add(m.group(1) or "")
    if len(found) != 1:
        raise WeightError(
            f"expected one audio encoder in {checkpoint} under one of {PREFIXES}; "
            f"found conv2d1.weight under {sorted(found) or 'none'}"
        )
    return found.pop()


def load_audio_encoder(
    cfg: Qwen3OmniAudioConfig,
    checkpoint: str | Path,
    *,
    prefix: str | None = None,
    dtype=jnp.float32,
    param_dtype=None,
    allow_cast: bool = True,
) -> Qwen3OmniAudioTower:
    """Loads the audio encoder from a Qwen3-Omni (or standalone encoder) checkpoint.

    Args:
      cfg: the encoder config.
      checkpoint: a `.safetensors` file, a sharded index, or a directory holding either.
      prefix: the encoder's key prefix (see `PREFIXES`); None detects it.
      dtype: computation dtype.
      param_dtype: parameter dtype; defaults to `dtype`.
      allow_cast: convert float tensors to `param_dtype` (e.g. a bf16 file into fp32).

    Raises:
      jaxsync.weights.WeightError: a missing, unknown or mis-shaped encoder tensor.
    """
    prefix = find_prefix(checkpoint) if prefix is None else prefix
    if prefix not in PREFIXES:
        raise ValueError(f"prefix {prefix!r} is not one of {PREFIXES}")
    param_dtype = dtype if param_dtype is None else param_dtype
    return load_weights(
        lambda: Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype),
        checkpoint,
        audio_rules(cfg),
        # The position table is a non-persistent buffer, derived from the config; tolerate it.
        select="^" + re.escape(prefix) + r"(?!positional_embedding\.)",
        strip=prefix,
        allow_cast=allow_cast,
    )
