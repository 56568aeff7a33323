"""`VoxtralAudioEncoder`: the host entry of the audio path, on raw audio (the log-mel computed
on the device: `_waveform_plan.py`) or the processor's `input_features` (plan, upload once, one
dispatch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import jaxsync
import jaxsync.check
from jaxsync._encoder import TowerEncoder, expect
from jaxsync._entry import alive
from jaxsync._out_sharding import OutSharding
from jaxsync.models.voxtral._config import MelConfig
from jaxsync.models.voxtral._mel_plan import front_end, stage_batch
from jaxsync.models.voxtral._modules import VoxtralAudioTower, server_form
from jaxsync.models.voxtral._plan import audio_given, features_check, features_planner
from jaxsync.models.voxtral._waveform_plan import audio_inputs, front_end_spec, waveform_planner
from jaxsync.models.voxtral._weights import load_model


FEATURES = "input_features"


class VoxtralAudioEncoder(TowerEncoder):
    """Audio in, audio embeddings out, in one dispatch of `jaxsync.TowerProgram(model,
    server_form(...))` per call (see `TowerEncoder`).

    Args:
      model: the loaded `VoxtralAudioTower`.
      mel_config: front-end config for raw audio (default: Whisper's 128-bin extractor with the
        model's bins); its `num_mel_bins` must match the model and its n_fft must be even.
      chunk_buckets: allowed padded window counts (default: powers of two).
      project: True: the projector's rows (the language model's audio embeddings); False: the
        Whisper encoder's `last_hidden_state` rows (`max_source_positions` per window).
      placement, out_sharding: as `TowerEncoder`'s.

    Attributes:
      cfg: the audio config; mel_config: the front end's; mel: its static settings.
    """

    load_model = staticmethod(load_model)

    def __init__(
        self,
        model: VoxtralAudioTower,
        mel_config: MelConfig | None = None,
        *,
        chunk_buckets: Sequence[int] | None = None,
        placement: Any = None,
        project: bool = True,
        out_sharding: OutSharding = None,
    ):
        expect(model, VoxtralAudioTower)
        if not isinstance(project, bool):
            raise TypeError(f"project must be a bool, got {type(project).__name__}")
        cfg = model.cfg
        self.mel_config, self.chunk_buckets = front_end(cfg.num_mel_bins, mel_config, chunk_buckets)
        self.mel = front_end_spec(self.mel_config, cfg.chunk_frames)
        self.project = project
        self.chunk_samples = cfg.chunk_frames * self.mel_config.hop_length
        # Device inputs, by kind (a [B, W] audio batch and [F, 2P] features share a shape):
        # one entry each over one plan cache.
        want = (cfg.num_mel_bins, cfg.chunk_frames)
        super().__init__(model, server_form(project), name=FEATURES, inside="inputs",
                         checks=(alive(FEATURES), features_check(cfg)), placement=placement,
                         out_sharding=out_sharding, rank=3, dtype=np.float32,
                         plan_of=lambda n: features_planner(n, cfg, self.chunk_buckets, project),
                         shape=lambda p: (p.chunks, *want))  # fmt: skip
        self._waveforms = self._program_of(model, server_form(project, self.mel))
        checks = (audio_inputs, self._inside)
        self._audio = self._entry_over(self._waveforms, name="waveforms", checks=checks,
                                       miss=self._from_audio)  # fmt: skip

    def lower(self, x: jax.Array, meta: jaxsync.Packed) -> Any:
        """`jax.jit(...).lower` of the program on device inputs: `[B, W]` waveforms or `[C, F,
        2P]` features (argument counts, HLO)."""
        return (self._waveforms if x.ndim == 2 else self.program).lower(x, meta)

    @jaxsync.check.entry_point
    def __call__(
        self,
        audio: Any = None,
        lengths: Any = None,
        *,
        input_features: Any = None,
        num_chunks: Any = None,
        attention_mask: Any = None,
        sampling_rate: int | None = None,
    ) -> jaxsync.Embeddings:
        """Audio embeddings of raw audio or of processor features (exactly one of the two).

        Args:
          audio: raw mono audio, each zero-padded to whole 30 s windows as the processor does:
            a list of 1-D waveforms, or a padded `[B, W]` batch (host data, or a device array
            whose width is the caller's bucket) with host `lengths` [B] (default: W for all).
          input_features: `[C, F, 2P]` (or `[F, 2P]`) log-mel windows as the processor returns
            them (numpy, torch CPU, or a device array whose C is the caller's bucket), with
            `num_chunks`, host windows per item (default: one item per window).
          attention_mask: accepted with `input_features` and unused: the Whisper encoder attends
            over whole windows, as transformers' does.
          sampling_rate: if given, must equal the front end's rate.

        Returns:
          `jaxsync.Embeddings.of` the forward's `Encoded` and its plan: item i owns rows
          `offsets[i] : offsets[i] + lengths[i]` (`tokens_per_chunk` per window, or
          `max_source_positions` with `project=False`); `extras["finite"]`, an on-device bool per
          padded item: every input value and output row of the item was finite.

        Raises:
          ValueError / TypeError: bad shapes, dtypes, lengths, NaN/inf host data, both or
            neither input, more windows than the largest chunk bucket, inputs on other devices
            than the weights; all before any upload or compile.
        """
        if audio_given(audio, lengths, input_features, num_chunks, attention_mask, sampling_rate,
                       self.mel_config):  # fmt: skip
            return self._audio(audio, lengths)
        return self._entry(input_features, num_chunks)

    def _from_audio(self, audio: Any, key: Any, lengths: Any) -> jaxsync.Embeddings:
        """A call on raw audio the call cache missed: a device batch is its own bucket; host
        samples are checked while staged, before a new plan's metadata goes up."""
        x, lens = audio_inputs(audio, lengths, self.mel_config)
        planner = waveform_planner(lens, self.cfg, self.mel_config,
                                   chunk_buckets=self.chunk_buckets,
                                   project=self.project)  # fmt: skip
        if isinstance(x, jax.Array):  # refuses bad plans before any upload
            self._inside(x)
            where = jaxsync.replicated_near(x)
            p = self._audio.planned(*planner(x, where)[:2], where)
            return self._audio.device(audio, key, p, unbatched=audio.ndim == 1)
        plan_key, build, shape = planner(x, self._meta_at)
        staged = stage_batch(x, lens, shape, self.placement)
        return self._audio.staged(x, staged, plan_key, build, self._meta_at, self.placement)
