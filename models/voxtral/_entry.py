"""`VoxtralAudioEncoder`: the host entry of the audio path (plan, upload once, one dispatch).

The Voxtral processor (and mistral-common ahead of vLLM) zero-pads every audio to a multiple of
30 s, computes the log-mel of the whole padded audio (its dynamic-range max spans all its
windows), cuts it into windows of `2 * max_source_positions` frames and encodes the stacked
windows. From raw audio the windows are the rows of the on-device log-mel, so no per-audio
spectrogram of the padded batch width is built, and the per-audio max is a segment max over its
windows. The processor's own `input_features` go straight in as well.

The entry compiles the server form's own functions (`forward`, `forward_waveforms`) with
`jaxsync.TowerProgram`, so a server's jit over the same state gives the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import jaxsync
import jaxsync.check
from jaxsync._calls import reads
from jaxsync._entry import TowerEntry, alive, on_devices
from jaxsync._host import host_array, host_ints
from jaxsync._plans import metadata_key
from jaxsync.models._sharding import OutSharding, check_placement
from jaxsync.models.voxtral._config import MelConfig
from jaxsync.models.voxtral._mel import MelSpec
from jaxsync.models.voxtral._mel_plan import (
    check_audio_list,
    check_waveforms,
    resolve_floor,
    stage_batch,
)
from jaxsync.models.voxtral._modules import VoxtralAudioTower, server_form
from jaxsync.models.voxtral._plan import (
    VoxtralPlan,
    VoxtralWaveformPlan,
    WaveformBuckets,
    plan,
    plan_waveforms,
    waveform_shape,
)


def _replicated(placement: Any) -> Any:
    """Where per-call metadata goes next to data uploaded to `placement` (whole, on each device)."""
    if isinstance(placement, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())
    return placement


class VoxtralAudioEncoder:
    """Audio in, audio embeddings out, in one compiled program per shape mix.

    The encoder snapshots the model's weights when built: after `nnx.update(model, ...)` call
    `load_state(model)` (no recompile) or the old weights keep serving.

    Args:
      model: the loaded `VoxtralAudioTower`; its `cfg` is the encoder's.
      mel_config: front-end config for raw audio (default: Whisper's 128-bin extractor with the
        model's bins); its `num_mel_bins` must match the model and its n_fft must be even (an
        odd one does not fill whole windows).
      chunk_buckets: allowed padded window counts (default: powers of two).
      placement: device or sharding for host uploads (default: where the weights live,
        replicated over their mesh); one on other devices than the weights is refused.
      project: True: the projector's rows (the language model's audio embeddings); False: the
        Whisper encoder's hidden states (`last_hidden_state` rows, `max_source_positions` per
        window).
      out_sharding: where the rows go (`forward`'s option): None replicates them over the
        weights' mesh; a `PartitionSpec` over that mesh or a `Sharding` as the server asks.

    Attributes:
      cfg: the audio config; mel_config: the front end's; mel: its static settings.
    """

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
        if not isinstance(model, VoxtralAudioTower):
            raise TypeError(f"model must be a VoxtralAudioTower, got {type(model).__name__}")
        if not isinstance(project, bool):
            raise TypeError(f"project must be a bool, got {type(project).__name__}")
        cfg = model.cfg
        mel_config = MelConfig(num_mel_bins=cfg.num_mel_bins) if mel_config is None else mel_config
        if not isinstance(mel_config, MelConfig):
            raise TypeError(
                f"mel_config must be a MelConfig or None, got {type(mel_config).__name__}"
            )
        if mel_config.num_mel_bins != cfg.num_mel_bins:
            raise ValueError(
                f"mel_config has {mel_config.num_mel_bins} mel bins, the encoder expects "
                f"{cfg.num_mel_bins}"
            )
        if mel_config.n_fft % 2:
            raise ValueError(
                f"n_fft={mel_config.n_fft} is odd: torch.stft then yields one frame less per "
                "signal, so 30 s windows would not fill (use log_mel_spectrogram for odd n_fft)"
            )
        if chunk_buckets is not None:
            chunk_buckets = tuple(
                int(b) for b in host_ints(chunk_buckets, name="chunk_buckets", minimum=1)
            )
            if not chunk_buckets:
                raise ValueError("chunk_buckets is empty")
        self.cfg, self.mel_config, self.project = cfg, mel_config, project
        self.chunk_samples = cfg.chunk_frames * mel_config.hop_length
        self.chunk_buckets = chunk_buckets
        floor = resolve_floor(mel_config, None)
        self.mel = MelSpec(
            mel_config, cfg.chunk_frames, mel_config.floor_value if floor == "global" else None
        )
        self._features = jaxsync.TowerProgram(model, server_form(project, None, out_sharding))
        self._waveforms = jaxsync.TowerProgram(model, server_form(project, self.mel, out_sharding))
        devices = frozenset(
            d for x in jax.tree.leaves(nnx.state(model)) for d in x.sharding.device_set
        )
        leaf = jax.tree.leaves(nnx.state(model))[0]
        check_placement(placement, leaf)
        if placement is None:
            placement = _replicated(leaf.sharding)
        self.placement = placement
        # Device inputs, by kind (a [B, W] audio batch and [F, 2P] features share a shape):
        # one entry each over one plan cache.
        inside = self._inside = on_devices(devices, "inputs")
        self._audio = TowerEntry(self._waveforms, name="waveforms", checks=(_waveforms, inside))
        self._input_features = TowerEntry(
            self._features,
            name=FEATURES,
            checks=(alive(FEATURES), self._check_features, inside),
            plans=self._audio.plans,
        )
        self._audio_calls, self._feature_calls = self._audio.calls, self._input_features.calls

    @property
    def num_state_args(self) -> int:
        """Jit arguments the weights take per call: the state's leaf count (depth-free)."""
        return self._features.num_state_args

    def load_state(self, model: VoxtralAudioTower) -> None:
        """Takes new weights (same structure, shapes, dtypes, placement) without recompiling."""
        self._features.load_state(model)
        self._waveforms.load_state(model)

    def lower(self, x: jax.Array, meta: jaxsync.Packed) -> Any:
        """`jax.jit(...).lower` of the program on device inputs: `[B, W]` waveforms or `[C, F,
        2P]` features (argument counts, HLO)."""
        return (self._waveforms if x.ndim == 2 else self._features).lower(x, meta)

    def _meta_placement(self, x: Any) -> Any:
        """Where a call's metadata goes: beside device inputs, else beside host uploads."""
        if isinstance(x, jax.Array):
            return jaxsync.replicated_near(x)
        return _replicated(self.placement)

    @reads("shape", "dtype")
    def _check_features(self, features: Any) -> None:
        """`[C, F, 2P]` (or `[F, 2P]`) float features with at least one window."""
        cfg = self.cfg
        shape = tuple(features.shape)
        shape = (1, *shape) if len(shape) == 2 else shape
        want = (cfg.num_mel_bins, cfg.chunk_frames)
        if len(shape) != 3 or shape[1:] != want:
            raise ValueError(f"input_features must be [C, {want[0]}, {want[1]}], got {shape}")
        if not np.issubdtype(features.dtype, np.floating) and features.dtype != jax.numpy.bfloat16:
            raise TypeError(f"input_features must be floating point, got {features.dtype}")
        if shape[0] == 0:
            raise ValueError("input_features has no windows")

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
        """Audio embeddings of raw audio or of processor features.

        Args:
          audio: raw mono audio: a list of 1-D waveforms, or a padded `[B, W]` batch (host data,
            or a device array whose width is the caller's bucket) with host `lengths` [B].
            Each audio is zero-padded to whole 30 s windows, as the Voxtral processor does.
          lengths: real samples per row of a padded `audio` batch (default: W for all).
          input_features: `[C, F, 2P]` (or `[F, 2P]`) log-mel windows, as
            `WhisperFeatureExtractor` / the Voxtral processor return them (numpy, torch CPU,
            or a device array whose C is the caller's bucket).
          num_chunks: host ints, windows per item of `input_features` (default: one item per
            window); items own consecutive windows.
          attention_mask: accepted with `input_features` and unused: the Whisper encoder attends
            over whole windows, as transformers' does.
          sampling_rate: if given, must equal the front end's rate.

        Returns:
          `jaxsync.Embeddings.of` the forward's `Encoded` and its plan: item i owns rows
          `offsets[i] : offsets[i] + lengths[i]` (`tokens_per_chunk` per window, or the
          encoder's `max_source_positions` rows with `project=False`); `extras["finite"]` is an
          on-device bool per padded item (the first B are the items): every input value and
          output row of the item was finite.

        Raises:
          ValueError / TypeError: bad shapes, dtypes, lengths, NaN/inf host data, both or
            neither input, more windows than the largest chunk bucket, inputs on other devices
            than the weights; all before any upload or compile.
        """
        key = None  # the signature a call on device inputs is kept under
        if sampling_rate is None and attention_mask is None:  # a kept call, if any
            if input_features is None:
                run, key = self._audio_calls.find(audio, lengths)
                if run is not None:
                    return run(audio)
            elif audio is None and lengths is None:
                run, key = self._feature_calls.find(input_features, num_chunks)
                if run is not None:
                    return run(input_features)
        if (audio is None) == (input_features is None):
            raise ValueError("pass exactly one of audio= and input_features=")
        if input_features is None:
            if num_chunks is not None or attention_mask is not None:
                raise ValueError("num_chunks and attention_mask go with input_features=")
            return self._from_audio(audio, lengths, sampling_rate, key)
        if lengths is not None or sampling_rate is not None:
            raise ValueError("lengths and sampling_rate go with audio=, not input_features=")
        return self._from_features(input_features, num_chunks, key)

    def _from_audio(
        self, audio: Any, lengths: Any, sampling_rate: Any, call_key: Any
    ) -> jaxsync.Embeddings:
        entry = self._audio
        if isinstance(audio, list | tuple):  # rows copied straight into their bucket
            if lengths is not None:
                raise ValueError("lengths go with a padded [B, W] batch, not a list of audios")
            x, lens = check_audio_list(audio, self.mel_config, sampling_rate=sampling_rate)
        else:
            x, lens = _waveforms(audio, lengths, self.mel_config, sampling_rate=sampling_rate)
        on_device = isinstance(x, jax.Array)
        if on_device:  # the caller's buffer is the bucket
            self._inside(x)
            buckets = WaveformBuckets(self.chunk_buckets, (x.shape[0],), (x.shape[1],))
            shape = tuple(x.shape)
        else:
            buckets = WaveformBuckets(self.chunk_buckets)
            shape = waveform_shape(lens, self.mel_config, buckets)
        where = self._meta_placement(x)

        def build() -> VoxtralWaveformPlan:
            mel = self.mel_config
            return plan_waveforms(lens, self.cfg, mel, buckets=buckets, project=self.project)

        key = ("audio", lens.tobytes(), shape, where)
        if on_device:  # refuses bad plans before any upload
            return entry.device(
                audio, call_key, entry.planned(key, build, where), unbatched=audio.ndim == 1
            )
        # samples checked while staged, before a new plan's metadata goes up
        ring = jaxsync.default_staging
        staged = stage_batch(x, lens, shape, self.placement)
        try:
            planned = entry.planned(key, build, where)
        except BaseException:
            ring.release(staged)
            raise
        return planned.finish(self._waveforms(ring.upload(staged), planned.meta))

    def _from_features(self, features: Any, num_chunks: Any, call_key: Any) -> jaxsync.Embeddings:
        entry = self._input_features
        on_device = isinstance(features, jax.Array)
        if on_device:
            entry.check(features)
        else:
            features = host_array(features, name=FEATURES)
            self._check_features(features)
        given = features
        if features.ndim == 2:
            features = features[None]
        rows = features.shape[0]
        where = self._meta_placement(features)
        # The plan, checks of num_chunks included, is cached per content of num_chunks: a
        # repeated call costs the key. Other host types are validated first, then keyed.
        key = ("ones",) if num_chunks is None else metadata_key(num_chunks)
        if key is None:
            num_chunks = _counts(num_chunks)
            key = metadata_key(num_chunks)

        def build() -> VoxtralPlan:
            counts = np.ones(rows, np.int64) if num_chunks is None else _counts(num_chunks)
            total = int(counts.sum())
            # A device array's rows are the caller's bucket; host windows are bucketed here.
            if total > rows or (total != rows and not on_device):
                raise ValueError(f"num_chunks sums to {total} but input_features has {rows}")
            buckets = (rows,) if on_device else self.chunk_buckets
            return plan(counts, self.cfg, buckets=buckets, project=self.project)

        key = ("features", key, rows, on_device, where)
        if on_device:
            planned = entry.planned(key, build, where)
            return entry.device(given, call_key, planned, unbatched=given.ndim == 2)
        want = (self.cfg.num_mel_bins, self.cfg.chunk_frames)
        return entry.host(
            features, key, build, where, shape=lambda p: (p.chunks, *want), dtype=np.float32,
            stage_at=self.placement,
        )  # fmt: skip


FEATURES = "input_features"


@reads("live", "dtype", "shape", "metadata")
def _waveforms(waveforms: Any, lengths: Any, config: MelConfig, *, sampling_rate: Any):
    """`check_waveforms`: what it reads of a device batch is declared for the call key."""
    return check_waveforms(waveforms, lengths, config, sampling_rate=sampling_rate)


def _counts(num_chunks: Any) -> np.ndarray:
    counts = host_ints(num_chunks, name="num_chunks", minimum=1)
    if counts.size == 0:
        raise ValueError("num_chunks is empty")
    return counts
