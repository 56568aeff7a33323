"""Configs of the Voxtral audio path: the Whisper log-mel front end and the audio encoder."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from jaxsync.hfconfig import as_dict, check_model_type, reject_unhandled


_GELU_ACTS = ("gelu",)  # transformers ACT2FN["gelu"] is the exact (erf) GELU


class _Ignored(NamedTuple):
    outer: frozenset[str]
    audio: frozenset[str]
    feature_extractor: frozenset[str]


IGNORED_FIELDS = _Ignored(
    # `VoxtralConfig` keys that `VoxtralForConditionalGeneration` never reads: the language
    # model takes its vocabulary from `text_config`, and the padding id and the loss's
    # `ignore_index` only concern text tokens and training.
    outer=frozenset({"vocab_size", "pad_token_id", "ignore_index"}),
    # `VoxtralEncoderConfig`: dropouts and layerdrop act in training only (the encoder runs in
    # eval mode); `initializer_range` only draws fresh weights; `vocab_size` is the Whisper
    # decoder's, which Voxtral does not have; `scale_embedding` sets an `embed_scale` that
    # `VoxtralEncoder.forward` never applies (we match that).
    audio=frozenset(
        "dropout attention_dropout activation_dropout layerdrop initializer_range vocab_size "
        "scale_embedding".split()
    ),
    # Feature-extractor attributes: `WhisperFeatureExtractor.__call__` normalises the waveform
    # only when its `do_normalize` *argument* is true, never from the attribute a saved
    # `preprocessor_config.json` sets (and `VoxtralProcessor` does not pass it);
    # `return_attention_mask` adds a mask output beside the same features; the class and
    # processor names are bookkeeping.
    feature_extractor=frozenset(
        "do_normalize return_attention_mask feature_extractor_type processor_class".split()
    ),
)
"""Keys accepted at any value because they cannot change the features or embeddings."""

# Feature-extractor attributes `MelConfig.from_feature_extractor` reads or checks; any other
# attribute (beyond `IGNORED_FIELDS.feature_extractor`) is refused.
_FE_READ = frozenset({
    "feature_size", "sampling_rate", "n_fft", "hop_length", "chunk_length", "global_log_mel_max",
    "win_length", "dither", "padding_value", "padding_side", "n_samples", "nb_max_frames",
})  # fmt: skip


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
            _positive_int(name, getattr(self, name))
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
        # Too many mel bins for n_fft also leaves a filter all zero: refused here, so no plan,
        # upload or trace ever sees such a config (the bank is cached per config).
        from jaxsync.models.voxtral._filters import slaney_mel_filters

        slaney_mel_filters(self)

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
            than n_fft, a non-zero padding value, left padding, a window width other than Whisper
            derives) or an attribute it does not know. Attributes in
            `IGNORED_FIELDS.feature_extractor` are accepted at any value.
          TypeError: an object without the extractor's size fields.
        """
        missing = [k for k in ("feature_size", "sampling_rate", "n_fft", "hop_length")
                   if not hasattr(fe, k)]  # fmt: skip
        if missing:
            raise TypeError(f"expected a Whisper-style feature extractor, got {type(fe).__name__} "
                            f"without {missing}")  # fmt: skip
        if getattr(fe, "dither", 0.0):
            raise ValueError(f"dither={fe.dither} is not supported (random noise is not parity)")
        # Audio is zero-padded at its end to whole windows (and to the batch width): another
        # padding value or side changes every padded window's features and its dynamic max.
        pad_value = getattr(fe, "padding_value", 0.0)
        if pad_value != 0.0:
            raise ValueError(f"padding_value={pad_value!r} is not supported (only 0.0)")
        pad_side = getattr(fe, "padding_side", "right")
        if pad_side != "right":
            raise ValueError(f"padding_side={pad_side!r} is not supported (only 'right')")
        win = getattr(fe, "win_length", fe.n_fft)
        if win != fe.n_fft:
            raise ValueError(f"win_length {win} != n_fft {fe.n_fft} is not supported")
        saved = fe.to_dict() if hasattr(fe, "to_dict") else {}
        unknown = sorted(set(saved) - _FE_READ - IGNORED_FIELDS.feature_extractor)
        if unknown:
            raise ValueError(f"unsupported feature-extractor attribute(s): {unknown}")
        chunk = getattr(fe, "chunk_length", 30)
        # Whisper derives these from the fields above; a changed one would pad to another width.
        n_samples = chunk * fe.sampling_rate
        for name, want in (("n_samples", n_samples), ("nb_max_frames", n_samples // fe.hop_length)):
            if getattr(fe, name, want) != want:
                raise ValueError(f"{name}={getattr(fe, name)!r} is not supported (need {want})")
        return cls(
            num_mel_bins=fe.feature_size,
            sampling_rate=fe.sampling_rate,
            n_fft=fe.n_fft,
            hop_length=fe.hop_length,
            chunk_length=chunk,
            global_log_mel_max=getattr(fe, "global_log_mel_max", None),
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
        ints = ("num_mel_bins", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_source_positions", "text_hidden_size")  # fmt: skip
        for name in ints:
            _positive_int(name, getattr(self, name))
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
    def from_hf_config(cls, src: Any) -> VoxtralAudioConfig:
        """From an HF `VoxtralConfig` / `VoxtralEncoderConfig`, their dict, or a checkpoint
        directory (its `config.json`); a full Voxtral config gives its `audio_config` plus the
        projector fields.

        The keys of `IGNORED_FIELDS` (dropouts, the text model's token ids, ...) are accepted at
        any value: they cannot change the result.

        Raises:
          ValueError: on a non-default HF field this port does not implement, or a config of
            another model (its `model_type`: e.g. AudioFlamingo3's encoder has the same fields
            but pools its output).
          jaxsync.weights.WeightError: a path without a readable `config.json` (a `ValueError`).
          TypeError: a non-integer where an integer is expected, or a source of another type.
        """
        d = as_dict(src, what="Voxtral")
        if "audio_config" in d or d.get("model_type") == "voxtral":
            audio = as_dict(d.get("audio_config") or {})
            text = as_dict(d.get("text_config") or {})
            outer = {k: v for k, v in d.items() if k not in ("audio_config", "text_config")}
            _reject_unhandled(
                outer, _OUTER_DEFAULTS, {"audio_token_id", "hidden_size"}, IGNORED_FIELDS.outer
            )
            act = outer.get("projector_hidden_act", "gelu")
            text_hidden = text.get("hidden_size", outer.get("hidden_size", cls.text_hidden_size))
            check_model_type(outer, "voxtral", what="Voxtral")
        else:
            audio, act, text_hidden = d, "gelu", cls.text_hidden_size
        check_model_type(audio, "voxtral_encoder", what="Voxtral encoder")
        handled = {
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_mel_bins", "max_source_positions", "activation_function",
            "head_dim", "num_key_value_heads",  # checked for consistency below
        }  # fmt: skip
        _reject_unhandled(audio, _ENCODER_DEFAULTS, handled, IGNORED_FIELDS.audio)
        get = lambda k: audio.get(k, _ENCODER_DEFAULTS[k])  # noqa: E731
        cfg = cls(
            num_mel_bins=get("num_mel_bins"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            max_source_positions=get("max_source_positions"),
            activation_function=get("activation_function"),
            projector_hidden_act=act,
            text_hidden_size=text_hidden,
        )
        for name, want in (("head_dim", cfg.head_dim), ("num_key_value_heads",
                           cfg.num_attention_heads)):  # fmt: skip
            if audio.get(name, want) != want:
                raise ValueError(f"audio {name}={audio[name]!r} is not supported (need {want})")
        return cfg


# transformers' VoxtralEncoderConfig / VoxtralConfig defaults (the fields that change the math).
_ENCODER_DEFAULTS: dict[str, Any] = dict(
    vocab_size=51866, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
    num_attention_heads=20, scale_embedding=False, activation_function="gelu", num_mel_bins=128,
    max_source_positions=1500, initializer_range=0.02, attention_dropout=0.0, dropout=0.0,
    layerdrop=0.0, activation_dropout=0.0,
)  # fmt: skip
_OUTER_DEFAULTS: dict[str, Any] = dict(audio_token_id=None, projector_hidden_act="gelu")


def _positive_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {v}")


def _reject_unhandled(got: dict, default: dict, handled: set[str], ignored: frozenset) -> None:
    reject_unhandled(got, default, handled, what="Voxtral", ignored=ignored)
