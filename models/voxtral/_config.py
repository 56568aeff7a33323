"""Configs of the Voxtral audio path: the Whisper log-mel front end and the audio encoder."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxsync.hfconfig import reject_unhandled


_GELU_ACTS = ("gelu",)  # transformers ACT2FN["gelu"] is the exact (erf) GELU


@dataclasses.dataclass(frozen=True, kw_only=True)
class MelConfig:
    """Log-mel front end (Whisper / Voxtral / mistral-common `audio_encoding_args`).

    Attributes:
      num_mel_bins: mel filters F (Voxtral, Whisper large-v3: 128; older Whisper: 80).
      sampling_rate: waveform rate in Hz; the filter bank spans 0..8 kHz, so it must be >= 16000
        (lower rates give all-zero filters, which mistral-common rejects too).
      n_fft: FFT size and (periodic Hann) window length; upstream `window_size`.
      hop_length: STFT hop in samples.
      chunk_length: seconds per Whisper window; `n_samples = chunk_length * sampling_rate` is the
        HF Whisper `max_length` (480000 samples, 3000 frames).
      min_frequency: lowest filter-bank frequency in Hz.
      max_frequency: highest filter-bank frequency in Hz.
      global_log_mel_max: fixed dynamic-range ceiling (Voxtral-Realtime: 1.5). It must be a Python
        float (an int such as 2 raises `TypeError`, as vLLM does). `None` *and 0.0* mean unset: vLLM
        tests it for truthiness, so 0.0 falls back to the dynamic max (HF's
        VoxtralRealtimeFeatureExtractor tests `is not None` and would floor at -8.0; we follow
        vLLM and say so).
    """

    num_mel_bins: int = 128
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    chunk_length: int = 30
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    global_log_mel_max: float | None = None

    def __post_init__(self) -> None:
        g = self.global_log_mel_max
        if g is not None:
            if not isinstance(g, float):
                raise TypeError(
                    f"global_log_mel_max must be a Python float, got {type(g).__name__} {g!r}"
                )
            if not math.isfinite(g):
                raise ValueError(f"global_log_mel_max must be finite, got {g!r}")
        for name in ("num_mel_bins", "sampling_rate", "n_fft", "hop_length", "chunk_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 <= self.min_frequency < self.max_frequency:
            raise ValueError(
                f"need 0 <= min_frequency < max_frequency, got {self.min_frequency}, "
                f"{self.max_frequency}"
            )
        if self.max_frequency > self.sampling_rate / 2:
            raise ValueError(
                f"max_frequency {self.max_frequency} Hz is above the Nyquist frequency of "
                f"sampling_rate={self.sampling_rate} Hz: the top mel filters would be all zero"
            )

    @property
    def floor_value(self) -> float | None:
        """`global_log_mel_max - 8.0` when set (truthy), else None (dynamic max)."""
        return self.global_log_mel_max - 8.0 if self.global_log_mel_max else None

    @property
    def n_samples(self) -> int:
        """Samples of one Whisper window (HF `max_length` default)."""
        return self.chunk_length * self.sampling_rate

    @classmethod
    def from_feature_extractor(cls, fe: Any) -> MelConfig:
        """From a transformers WhisperFeatureExtractor or VoxtralRealtimeFeatureExtractor.

        Raises:
          ValueError: on settings this front end does not implement (dither, a window shorter
            than n_fft, normalisation).
        """
        if getattr(fe, "dither", 0.0):
            raise ValueError(f"dither={fe.dither} is not supported (random noise is not parity)")
        win = getattr(fe, "win_length", fe.n_fft)
        if win != fe.n_fft:
            raise ValueError(f"win_length {win} != n_fft {fe.n_fft} is not supported")
        if getattr(fe, "do_normalize", False):
            raise ValueError("do_normalize=True is not supported")
        g = getattr(fe, "global_log_mel_max", None)
        return cls(
            num_mel_bins=fe.feature_size,
            sampling_rate=fe.sampling_rate,
            n_fft=fe.n_fft,
            hop_length=fe.hop_length,
            chunk_length=getattr(fe, "chunk_length", 30),
            global_log_mel_max=g,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class VoxtralAudioConfig:
    """Voxtral audio encoder (Whisper encoder) plus the multimodal projector.

    Attributes:
      num_mel_bins: input mel bins F.
      hidden_size: encoder width D.
      intermediate_size: encoder MLP width; the projector also reads `intermediate_size //
        hidden_size` consecutive frames as one vector (4 in every released checkpoint).
      num_hidden_layers: encoder layers L.
      num_attention_heads: attention heads N.
      max_source_positions: encoder positions per window (1500); one window is
        `2 * max_source_positions` mel frames (conv2 has stride 2).
      layer_norm_eps: LayerNorm epsilon (torch default 1e-5).
      activation_function: encoder MLP activation (only "gelu").
      projector_hidden_act: projector activation (only "gelu").
      text_hidden_size: projector output width (the language model's hidden size).
    """

    num_mel_bins: int = 128
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 20
    max_source_positions: int = 1500
    layer_norm_eps: float = 1e-5
    activation_function: str = "gelu"
    projector_hidden_act: str = "gelu"
    text_hidden_size: int = 3072

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.intermediate_size % self.hidden_size:
            raise ValueError(
                f"intermediate_size {self.intermediate_size} must be a multiple of hidden_size "
                f"{self.hidden_size}: the projector groups intermediate_size // hidden_size frames"
            )
        if self.max_source_positions % self.frames_per_token:
            raise ValueError(
                f"max_source_positions {self.max_source_positions} must be a multiple of "
                f"{self.frames_per_token} so that projector groups never straddle two windows"
            )
        for name, act in (("activation_function", self.activation_function),
                          ("projector_hidden_act", self.projector_hidden_act)):  # fmt: skip
            if act not in _GELU_ACTS:
                raise ValueError(f"{name}={act!r} is not supported (only {_GELU_ACTS})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def frames_per_token(self) -> int:
        """Encoder frames concatenated into one projector input (4)."""
        return self.intermediate_size // self.hidden_size

    @property
    def chunk_frames(self) -> int:
        """Mel frames per encoder window (3000)."""
        return 2 * self.max_source_positions

    @property
    def tokens_per_chunk(self) -> int:
        """Projected audio embeddings per window (375)."""
        return self.max_source_positions // self.frames_per_token

    @classmethod
    def from_hf_config(cls, hf_cfg: Any) -> VoxtralAudioConfig:
        """From a transformers `VoxtralConfig` (or its `audio_config` plus defaults).

        Dropouts and layerdrop are inference no-ops; `scale_embedding` is ignored because
        transformers' VoxtralEncoder computes `embed_scale` but never applies it (we match that).

        Raises:
          ValueError: on a non-default HF field this port does not implement.
        """
        from transformers import VoxtralConfig, VoxtralEncoderConfig

        if isinstance(hf_cfg, VoxtralConfig):
            audio, act, text_hidden = (
                hf_cfg.audio_config, hf_cfg.projector_hidden_act, hf_cfg.text_config.hidden_size
            )  # fmt: skip
            outer = {k: v for k, v in hf_cfg.to_dict().items() if k not in
                     ("audio_config", "text_config")}  # fmt: skip
            _reject_unhandled(outer, VoxtralConfig().to_dict(), {"projector_hidden_act",
                              "audio_token_id", "hidden_size"})  # fmt: skip
        elif isinstance(hf_cfg, VoxtralEncoderConfig):
            audio, act, text_hidden = hf_cfg, "gelu", cls.text_hidden_size
        else:
            raise TypeError(f"expected VoxtralConfig or VoxtralEncoderConfig, got {type(hf_cfg)}")
        handled = {
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_mel_bins", "max_source_positions", "activation_function", "scale_embedding",
            "dropout", "attention_dropout", "activation_dropout", "layerdrop", "initializer_range",
            "vocab_size",  # Whisper decoder vocabulary: unused by the encoder
        }  # fmt: skip
        _reject_unhandled(audio.to_dict(), VoxtralEncoderConfig().to_dict(), handled)
        return cls(
            num_mel_bins=audio.num_mel_bins,
            hidden_size=audio.hidden_size,
            intermediate_size=audio.intermediate_size,
            num_hidden_layers=audio.num_hidden_layers,
            num_attention_heads=audio.num_attention_heads,
            max_source_positions=audio.max_source_positions,
            activation_function=audio.activation_function,
            projector_hidden_act=act,
            text_hidden_size=text_hidden,
        )


def _reject_unhandled(got: dict, default: dict, handled: set[str]) -> None:
    reject_unhandled(got, default, handled, what="Voxtral")
