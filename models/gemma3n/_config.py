"""Configuration of the Gemma 3n audio path (audio tower, audio embedder, padding)."""

import dataclasses
import numbers
from typing import Any, Literal

import numpy as np

from jaxsync.hfconfig import as_dict, check_model_type, unhandled_fields


__all__ = ["Gemma3nAudioConfig", "from_hf_config"]

# `Gemma3nAudioConfig` keys accepted at any value beyond jaxsync.hfconfig.GENERIC_FIELDS:
# `initializer_range` only draws fresh weights (training), never a loaded checkpoint's result.
IGNORED_FIELDS = frozenset({"initializer_range"})

# HF audio-config names that differ from ours.
_HF_TO_OURS = {"vocab_size": "audio_vocab_size", "vocab_offset": "audio_vocab_offset"}

# Audio-config fields read by this port; every other non-default field is rejected.
_AUDIO_FIELDS = (
    "vocab_size",
    "vocab_offset",
    "input_feat_size",
    "hidden_size",
    "rms_norm_eps",
    "gradient_clipping",
    "conf_attention_chunk_size",
    "conf_attention_context_left",
    "conf_attention_context_right",
    "conf_attention_logit_cap",
    "conf_num_attention_heads",
    "conf_num_hidden_layers",
    "conf_conv_kernel_size",
    "conf_reduction_factor",
    "conf_residual_weight",
    "sscp_conv_channel_size",
    "sscp_conv_group_norm_eps",
    "sscp_conv_kernel_size",
    "sscp_conv_stride_size",
)


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list | tuple) else x


def _leaves(x: Any) -> list[Any]:
    return [v for item in x for v in _leaves(item)] if isinstance(x, list | tuple) else [x]


def _check_types(cfg: "Gemma3nAudioConfig") -> None:
    """Integer fields (and tuples of them) hold ints, float fields real numbers; no bools."""
    for f in dataclasses.fields(cfg):
        if f.name == "overflow":
            continue
        kind = numbers.Integral if "int" in str(f.type) else numbers.Real
        for v in _leaves(getattr(cfg, f.name)):
            if isinstance(v, bool | np.bool_) or not isinstance(v, kind):
                want = "an int" if kind is numbers.Integral else "a real number"
                raise TypeError(f"{f.name} must hold {want}, got {type(v).__name__} {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3nAudioConfig:
    """Gemma 3n audio tower + audio embedder + fixed-length padding.

    Defaults are the released `google/gemma-3n-E4B` values.

    Attributes:
        input_feat_size: mel bins F of the input features.
        hidden_size: conformer width D_a.
        rms_norm_eps: eps of the light-conv norms and of the audio embedder norms (the other
            conformer norms use HF's fixed 1e-6, as upstream does).
        gradient_clipping: clamp bound of the conformer's activation clipping (identity in
            practice).
        conf_attention_chunk_size: query block size W of the chunked local attention.
        conf_attention_context_left: left context (including the current frame) of the attention.
        conf_attention_context_right: right context of the attention.
        conf_attention_logit_cap: tanh soft-cap on the attention logits.
        conf_num_attention_heads: attention heads N.
        conf_num_hidden_layers: conformer blocks.
        conf_conv_kernel_size: causal depthwise conv kernel of the light conv.
        conf_reduction_factor: time stride applied after the conformer.
        conf_residual_weight: residual scale of the feed-forward halves.
        sscp_conv_channel_size: output channels of the two sub-sample conv blocks.
        sscp_conv_group_norm_eps: eps of the cumulative group norms.
        sscp_conv_kernel_size: (time, freq) kernels of the two conv blocks.
        sscp_conv_stride_size: (time, freq) strides of the two conv blocks.
        audio_vocab_size: rows of the audio hard-embedding table.
        audio_vocab_offset: first token id of the audio vocabulary.
        text_hidden_size: language-model width D (output of the embedder).
        text_vocab_size: text vocabulary size; the padding token is `text_vocab_size - 1`.
        soft_tokens: audio embeddings per clip (`audio_soft_tokens_per_image`).
        audio_token_id: placeholder token id in the prompt that audio embeddings replace.
        overflow: what to do when the tower yields more than `soft_tokens` positions: "error"
            (transformers: its negative `expand` raises) or "truncate" (vLLM: keep the first
            `soft_tokens`, warn on the host).
    """

    input_feat_size: int = 128
    hidden_size: int = 1536
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    conf_attention_chunk_size: int = 12
    conf_attention_context_left: int = 13
    conf_attention_context_right: int = 0
    conf_attention_logit_cap: float = 50.0
    conf_num_attention_heads: int = 8
    conf_num_hidden_layers: int = 12
    conf_conv_kernel_size: int = 5
    conf_reduction_factor: int = 4
    conf_residual_weight: float = 0.5
    sscp_conv_channel_size: tuple[int, int] = (128, 32)
    sscp_conv_group_norm_eps: float = 1e-3
    sscp_conv_kernel_size: tuple[tuple[int, int], tuple[int, int]] = ((3, 3), (3, 3))
    sscp_conv_stride_size: tuple[tuple[int, int], tuple[int, int]] = ((2, 2), (2, 2))
    audio_vocab_size: int = 128
    audio_vocab_offset: int = 262_272
    text_hidden_size: int = 2048
    text_vocab_size: int = 262_400
    soft_tokens: int = 188
    audio_token_id: int = 262_273
    overflow: Literal["error", "truncate"] = "error"

    def __post_init__(self):
        _check_types(self)
        if self.hidden_size % self.conf_num_attention_heads:
            raise ValueError("hidden_size must be a multiple of conf_num_attention_heads")
        if self.hidden_size % 2:
            raise ValueError("hidden_size must be even (sinusoidal position table has D/2 pairs)")
        for name in ("sscp_conv_channel_size", "sscp_conv_kernel_size", "sscp_conv_stride_size"):
            if len(getattr(self, name)) != 2:
                raise ValueError(f"{name} must have exactly 2 entries (two SSCP conv blocks)")
        if self.conf_attention_chunk_size < 1 or self.conf_reduction_factor < 1:
            raise ValueError("conf_attention_chunk_size and conf_reduction_factor must be >= 1")
        if self.conf_attention_context_left < 0 or self.conf_attention_context_right < 0:
            raise ValueError("attention contexts must be >= 0")
        if self.soft_tokens < 1:
            raise ValueError("soft_tokens must be >= 1")
        pad_id = self.text_vocab_size - 1
        if not self.audio_vocab_offset <= pad_id < self.audio_vocab_offset + self.audio_vocab_size:
            raise ValueError(
                f"padding id text_vocab_size-1={pad_id} must lie in the audio vocabulary "
                f"[{self.audio_vocab_offset}, {self.audio_vocab_offset + self.audio_vocab_size})"
            )
        if self.overflow not in ("error", "truncate"):
            raise ValueError(f"overflow must be 'error' or 'truncate', got {self.overflow!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.conf_num_attention_heads

    @property
    def pad_row(self) -> int:
        """Row of the audio embedding table that the padding token selects."""
        return self.text_vocab_size - 1 - self.audio_vocab_offset

    @property
    def time_stride(self) -> int:
        """Total time stride of the SSCP convs."""
        return self.sscp_conv_stride_size[0][0] * self.sscp_conv_stride_size[1][0]

    def num_subsampled(self, frames: int) -> int:
        """SSCP output length for `frames` input frames (reverse-causal padding of kernel - 1)."""
        t = frames
        for (kt, _), (st, _) in zip(
            self.sscp_conv_kernel_size, self.sscp_conv_stride_size, strict=True
        ):
            t = (t + kt - 1 - kt) // st + 1
        return t

    def num_tower_positions(self, frames: int) -> int:
        """Tower output length for `frames` input frames (SSCP, then the `[::R]` reduction)."""
        return -(-self.num_subsampled(frames) // self.conf_reduction_factor)

    @classmethod
    def from_hf_config(cls, src: Any, **overrides: Any) -> "Gemma3nAudioConfig":
        """Builds the config from a Gemma 3n config: see the module-level `from_hf_config`."""
        return from_hf_config(src, **overrides)


def _sub(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    sub = cfg.get(name) or {}
    return as_dict(sub)


def from_hf_config(src: Any, **overrides: Any) -> Gemma3nAudioConfig:
    """Builds the config from a full Gemma 3n config (it needs the audio and text parts).

    Args:
        src: a transformers `Gemma3nConfig`, its dict (`to_dict()` / `config.json`), or a
            checkpoint directory / `config.json` path. Missing fields take transformers'
            defaults (the released values, this class's defaults).
        **overrides: jaxsync-only fields (`overflow`) or replacements (`soft_tokens`).

    Raises:
        ValueError: no `audio_config` in `src`, an audio-config field this port does not
            handle is set to a value other than transformers' default (unknown fields included),
            or the config of another model (its `model_type`).
        TypeError: a non-integer (float, bool) for an integer field.
    """
    cfg = as_dict(src, what="Gemma 3n")
    if "audio_config" not in cfg:
        raise ValueError(
            "expected a full Gemma 3n config with an 'audio_config' (and 'text_config'); "
            f"got fields {sorted(cfg)[:8]}"
        )
    # Gemma 4's configs reuse the outer layout (its audio tower is another model).
    check_model_type(cfg, "gemma3n", what="Gemma 3n")
    audio = _sub(cfg, "audio_config")
    check_model_type(audio, "gemma3n_audio", what="Gemma 3n audio")
    defaults = {f: getattr(Gemma3nAudioConfig, _HF_TO_OURS.get(f, f)) for f in _AUDIO_FIELDS}
    bad = unhandled_fields(audio, defaults, _AUDIO_FIELDS, ignored=IGNORED_FIELDS)
    if bad:
        raise ValueError(f"unsupported non-default Gemma3nAudioConfig fields: {sorted(bad)}")
    kwargs = {_HF_TO_OURS.get(f, f): _tuplify(audio[f]) for f in _AUDIO_FIELDS if f in audio}
    text = _sub(cfg, "text_config")
    top = {
        "text_hidden_size": text.get("hidden_size"),
        "text_vocab_size": text.get("vocab_size"),
        "soft_tokens": cfg.get("audio_soft_tokens_per_image"),
        "audio_token_id": cfg.get("audio_token_id"),
    }
    kwargs.update({k: v for k, v in top.items() if v is not None})
    kwargs.update(overrides)
    return Gemma3nAudioConfig(**kwargs)
