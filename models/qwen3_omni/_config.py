"""Configuration of the Qwen3-Omni audio encoder (`Qwen3OmniMoeAudioEncoderConfig`).

`from_hf_config` is strict: every field that changes the computation is modelled, fields that are
inert at inference are accepted, and anything else that differs from the HF default raises.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsync._host import host_int
from jaxsync.hfconfig import as_dict, check_model_type, unhandled_fields
from jaxsync.models._activations import ACTIVATION_NAMES, ActivationName


# `Qwen3OmniMoeAudioEncoderConfig` keys accepted at any value beyond
# jaxsync.hfconfig.GENERIC_FIELDS, inert at inference: dropouts are off in eval mode,
# `initializer_range` only draws fresh weights, and `conv_chunksize` only splits the conv batch
# into loops (same numbers, see `_modules.py`).
IGNORED_FIELDS = frozenset(
    {"dropout", "attention_dropout", "activation_dropout", "initializer_range", "conv_chunksize"}
)
_MODELLED_FIELDS = (
    "num_mel_bins",
    "encoder_layers",
    "encoder_attention_heads",
    "encoder_ffn_dim",
    "d_model",
    "activation_function",
    "max_source_positions",
    "n_window",
    "n_window_infer",
    "output_dim",
    "downsample_hidden_size",
)
# transformers' `Qwen3OmniMoeAudioEncoderConfig()` defaults beyond the generic fields, kept here so
# the product reads configs identically with or without transformers installed; a test pins them
# to the class.
HF_DEFAULTS: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "d_model": 1280,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_function": "gelu",
    "activation_dropout": 0.0,
    "scale_embedding": False,
    "initializer_range": 0.02,
    "max_source_positions": 1500,
    "n_window": 50,
    "output_dim": 3584,
    "n_window_infer": 800,
    "conv_chunksize": 500,
    "downsample_hidden_size": 480,
}

# HF computes `embed_scale` from it but never applies it; a checkpoint that sets it expects
# something HF does not do, so we refuse instead of guessing.
_REJECTED_DEFAULTS = {"scale_embedding": False}

TOKENS_PER_FULL_CHUNK = 13
"""Upstream hard-codes 13 tokens per full chunk (= three stride-2 convs applied to 100 frames)."""


def conv_out_len(n: int) -> int:
    """Length after one Conv(k=3, s=2, p=1): `(n - 1) // 2 + 1` with floor division (0 -> 0)."""
    return (n - 1) // 2 + 1


def conv3_out_len(n: int) -> int:
    """Length after the three stride-2 convolutions."""
    return conv_out_len(conv_out_len(conv_out_len(n)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3OmniAudioConfig:
    """The Qwen3-Omni audio encoder (defaults = HF `Qwen3OmniMoeAudioEncoderConfig`).

    Attributes:
      num_mel_bins: mel bins F of the input features.
      encoder_layers: transformer layers.
      encoder_attention_heads: attention heads N (head dim = d_model / N).
      encoder_ffn_dim: MLP hidden size.
      d_model: model width D.
      activation_function: activation of the MLPs and between `proj1` and `proj2` (HF `ACT2FN`
        name; "gelu" is the exact erf GELU). The convolutions always use exact GELU.
      max_source_positions: rows of the sinusoidal position table.
      n_window: half the chunk length in mel frames (chunks are `2 * n_window` frames).
      n_window_infer: attention window in mel frames; a window holds
        `n_window_infer // (2 * n_window)` chunks.
      output_dim: output width of `proj2`.
      downsample_hidden_size: channels of the three convolutions.
    """

    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    activation_function: ActivationName = "gelu"
    max_source_positions: int = 1500
    n_window: int = 50
    n_window_infer: int = 800
    output_dim: int = 3584
    downsample_hidden_size: int = 480

    def __post_init__(self) -> None:
        ints = (*_MODELLED_FIELDS[:5], *_MODELLED_FIELDS[6:])
        for name in ints:  # bools and floats (even 2.0) are TypeError: never truncated
            host_int(getattr(self, name), name=f"Qwen3OmniAudioConfig.{name}", minimum=1)
        if not isinstance(self.activation_function, str):
            raise TypeError(
                "Qwen3OmniAudioConfig.activation_function must be a str, got "
                f"{type(self.activation_function).__name__}"
            )
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by encoder_attention_heads "
                f"({self.encoder_attention_heads})"
            )
        if self.d_model % 2 or self.d_model < 4:
            raise ValueError(f"the sinusoidal table needs an even d_model >= 4, got {self.d_model}")
        if conv3_out_len(self.chunk_len) != TOKENS_PER_FULL_CHUNK:
            raise ValueError(
                f"n_window={self.n_window}: upstream counts {TOKENS_PER_FULL_CHUNK} tokens per "
                f"full chunk, but {self.chunk_len} frames give {conv3_out_len(self.chunk_len)} "
                "after the convolutions; only n_window in 49..52 is self-consistent (released: 50)"
            )
        if self.chunks_per_window < 1:
            raise ValueError(
                f"n_window_infer ({self.n_window_infer}) must be >= 2 * n_window "
                f"({self.chunk_len}); upstream divides by a zero-token window otherwise"
            )
        if self.max_source_positions < TOKENS_PER_FULL_CHUNK:
            raise ValueError(f"max_source_positions must be >= {TOKENS_PER_FULL_CHUNK}")
        if self.activation_function not in ACTIVATION_NAMES:
            raise ValueError(
                f"activation_function {self.activation_function!r} is not supported; "
                f"one of {ACTIVATION_NAMES}"
            )

    @property
    def head_dim(self) -> int:
        """Per-head width H."""
        return self.d_model // self.encoder_attention_heads

    @property
    def chunk_len(self) -> int:
        """Mel frames per full chunk (100 released)."""
        return 2 * self.n_window

    @property
    def chunks_per_window(self) -> int:
        """Chunks per attention window (8 released)."""
        return self.n_window_infer // self.chunk_len

    @property
    def window_tokens(self) -> int:
        """Token slots per attention window (104 released)."""
        return self.chunks_per_window * TOKENS_PER_FULL_CHUNK

    @property
    def conv_freq_bins(self) -> int:
        """Mel bins left after the three convolutions (16 for 128)."""
        return conv3_out_len(self.num_mel_bins)

    @classmethod
    def from_hf_config(cls, src: Any) -> Qwen3OmniAudioConfig:
        """Builds the config from an HF audio-encoder config: an object, a dict, a `config.json`
        path or a checkpoint directory holding one.

        A full `Qwen3OmniMoeConfig` or thinker config is accepted too: its `audio_config` is used.

        Raises:
          ValueError: a field that changes the computation and is not modelled differs from the
            HF default, a modelled value is invalid, or the config is another model's (its
            `model_type`).
          TypeError: a non-integer (a bool, a float such as 2.0) where an integer is expected.
        """
        cfg = as_dict(src, what="Qwen3-Omni audio")
        if "thinker_config" in cfg:
            check_model_type(cfg, "qwen3_omni_moe", what="Qwen3-Omni")
            cfg = as_dict(cfg["thinker_config"])
        if "audio_config" in cfg:
            check_model_type(cfg, "qwen3_omni_moe_thinker", what="Qwen3-Omni thinker")
            cfg = as_dict(cfg["audio_config"])
        # Qwen2.5-Omni's audio encoder shares these field names but not the downsampling.
        check_model_type(cfg, "qwen3_omni_moe_audio_encoder", what="Qwen3-Omni audio encoder")
        ignored = IGNORED_FIELDS | set(_REJECTED_DEFAULTS)
        bad = unhandled_fields(cfg, HF_DEFAULTS, _MODELLED_FIELDS, ignored=ignored)
        bad.update({k: cfg[k] for k, v in _REJECTED_DEFAULTS.items() if k in cfg and cfg[k] != v})
        if bad:
            raise ValueError(f"unsupported non-default Qwen3-Omni audio config fields: {bad}")
        return cls(**{k: cfg[k] for k in _MODELLED_FIELDS if k in cfg})
