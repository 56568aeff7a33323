"""Waveform -> log-mel -> Voxtral encoder -> projector, as one jitted call with host-side planning.

The Voxtral processor (and mistral-common ahead of vLLM) zero-pads every audio to a multiple of
30 s, computes the log-mel of the whole padded audio (its dynamic-range max spans all its windows),
cuts it into windows of `2 * max_source_positions` frames and runs the encoder on the stacked
windows. Here the windows are the rows of `log_mel_rows`, so no per-audio spectrogram of the padded
batch width is ever built, and the per-audio max is a segment max over its windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsync
import jaxsync.check
from jaxsync.models.voxtral._config import MelConfig, VoxtralAudioConfig
from jaxsync.models.voxtral._filters import device_tables
from jaxsync.models.voxtral._mel import MelSpec, log_mel_rows, plan_waveforms, resolve_floor
from jaxsync.models.voxtral._modules import AudioEncoder, Projector
from jaxsync.models.voxtral._spectrum import spectral_float64


class VoxtralAudioModel(nnx.Module):
    """`audio_tower` (encoder) plus `multi_modal_projector`, named as in transformers."""

    def __init__(
        self,
        cfg: VoxtralAudioConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.audio_tower = AudioEncoder(cfg, **kw)
        self.multi_modal_projector = Projector(cfg, **kw)
        self.config = cfg

    def encode(self, mel: jax.Array) -> jax.Array:  # [C, F, 2P] -> [C, P, D]
        """transformers `VoxtralEncoder(...).last_hidden_state`."""
        return self.audio_tower(mel)

    def audio_features(self, mel: jax.Array) -> jax.Array:  # [C, F, 2P] -> [C * P/4, V_hidden]
        """transformers `get_audio_features(mel).pooler_output`."""
        out = self.multi_modal_projector(self.audio_tower(mel))
        return out.reshape(-1, out.shape[-1])

    def embed_waveforms(
        self,
        x: jax.Array,
        meta: jaxsync.Packed,
        filters: jax.Array,
        window: jax.Array,
        *,
        spec: MelSpec,
    ) -> tuple[jax.Array, jax.Array]:
        """Padded waveforms `[B, W]` + window plan -> `[C * P/4, V_hidden]`, finite `[B]`."""
        mel, finite = log_mel_rows(x, meta, filters, window, spec=spec)  # [C, F, 2P]
        return self.audio_features(mel), finite


class AudioEmbeddings(NamedTuple):
    """Result of `VoxtralAudioEmbedder.__call__`.

    Attributes:
      embeddings: `[C_pad * tokens_per_chunk, V_hidden]` device array; audio i owns the
        `num_tokens[i]` rows starting at `offsets[i]`; rows after `offsets[-1] + num_tokens[-1]`
        are bucket padding.
      finite: `[B_pad]` device bool, every real sample of the audio was finite.
      num_chunks: `[B]` host int, 30-second windows per audio.
      num_tokens: `[B]` host int, embeddings per audio.
      offsets: `[B]` host int, first embedding row per audio.
    """

    embeddings: jax.Array
    finite: jax.Array
    num_chunks: np.ndarray
    num_tokens: np.ndarray
    offsets: np.ndarray


class VoxtralAudioEmbedder:
    """Host front of the audio path: plans, uploads once, dispatches one jitted program.

    Args:
      model: the loaded `VoxtralAudioModel`.
      mel_config: front-end config (its `num_mel_bins` must match the encoder).
      chunk_buckets: allowed padded window counts (default: powers of two).
      placement: device or sharding for uploads and tables.
    """

    def __init__(
        self,
        model: VoxtralAudioModel,
        mel_config: MelConfig,
        *,
        chunk_buckets: Sequence[int] | None = None,
        placement=None,
    ):
        cfg = model.config
        if mel_config.num_mel_bins != cfg.num_mel_bins:
            raise ValueError(
                f"mel_config has {mel_config.num_mel_bins} mel bins, the encoder expects "
                f"{cfg.num_mel_bins}"
            )
        self.config, self.mel_config = cfg, mel_config
        self.chunk_samples = cfg.chunk_frames * mel_config.hop_length
        self.chunk_buckets = chunk_buckets
        self.placement = placement
        self._embed = jaxsync.jit_method(model, "embed_waveforms", static_argnames=("spec",))
        self._features = jaxsync.jit_method(model, "audio_features")

    @jaxsync.check.entry_point
    def __call__(
        self,
        waveforms: np.ndarray | jax.Array,
        lengths: Sequence[int] | np.ndarray | None = None,
        *,
        sampling_rate: int | None = None,
    ) -> AudioEmbeddings:
        """Audio embeddings of a padded waveform batch `[B, W]` with host `lengths` `[B]`.

        Every audio is zero-padded to a multiple of 30 s (as the Voxtral processor and
        mistral-common do); the floor is the configured `global_log_mel_max` when set, else the
        max over the whole padded audio.
        """
        floor = resolve_floor(self.mel_config, None)
        plan = plan_waveforms(
            waveforms, lengths, self.mel_config, floor=floor,
            pad_to_multiple_of=self.chunk_samples, sampling_rate=sampling_rate,
            placement=self.placement,
        )  # fmt: skip
        num_chunks = plan.signal // self.chunk_samples
        total = int(num_chunks.sum())
        c_pad = jaxsync.bucket(total, self.chunk_buckets, minimum=1)
        frames = self.config.chunk_frames
        row_audio = np.zeros(c_pad, np.int32)
        row_audio[:total] = np.repeat(np.arange(plan.batch), num_chunks)
        first = np.concatenate([[0], np.cumsum(num_chunks)[:-1]])
        row_frame0 = np.zeros(c_pad, np.int32)
        row_frame0[:total] = (np.arange(total) - np.repeat(first, num_chunks)) * frames
        row_frames = np.zeros(c_pad, np.int32)
        row_frames[:total] = frames
        fields = plan.audio_fields()
        fields.update(row_audio=row_audio, row_frame0=row_frame0, row_frames=row_frames)
        meta = jaxsync.upload_packed(fields, placement=self.placement)
        filters, window = device_tables(self.mel_config, self.placement)
        floor_value = self.mel_config.floor_value if floor == "global" else None
        mc = self.mel_config
        spec = MelSpec(mc.n_fft, mc.hop_length, frames, floor_value, spectral_float64(plan.x))
        emb, finite = self._embed(plan.x, meta, filters, window, spec=spec)
        tokens = num_chunks * self.config.tokens_per_chunk
        return AudioEmbeddings(
            emb, finite, num_chunks, tokens, first * self.config.tokens_per_chunk
        )

    @jaxsync.check.entry_point
    def from_features(self, mel: jax.Array) -> jax.Array:
        """Encoder + projector on ready log-mel windows `[C, F, 2P]` (transformers
        `get_audio_features`); bucket C yourself to share programs."""
        return self._features(mel)
