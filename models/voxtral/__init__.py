"""Voxtral audio path (vLLM PR #51458), sync-free in JAX.

Three layers, as every model family:
* Planner (`_plan.py`, NumPy only): `plan(num_chunks, cfg)` -> `VoxtralPlan` for features and
  `plan_waveforms(lengths, cfg, mel_config)` -> `VoxtralWaveformPlan` for raw audio: typed
  `meta` for one `jaxsync.upload_packed(plan)`, `lengths` (output rows per item), and every
  static pad picked from buckets; the front end's waveform checks and `plan_log_mel` are in
  `_mel_plan.py`.
* Pure forward: `forward(tower, features, meta)` (log-mel windows -> `jaxsync.Encoded`) and
  `forward_waveforms(tower, waveforms, meta, mel=plan.mel)`, callable inside a server's own jit
  with the weights as arguments; `log_mel_rows` and `log_mel_floor` (vLLM's dynamic-range clamp
  with Python scalars) are the front end's pure pieces.
* Entry: `VoxtralAudioEncoder(tower, mel_config, project=True)` takes raw audio (`audio=`) or
  the processor's `input_features=` and returns `jaxsync.Embeddings` (`project=False`: the
  Whisper encoder's hidden states); it compiles the pure forwards themselves (`server_form`)
  with `jaxsync.TowerProgram`. `log_mel_spectrogram` is the front end's
  own entry (on-device Whisper log-mel: periodic Hann, centre-reflect STFT, last frame dropped,
  Slaney filters, log10, the three upstream floor variants, (x + 4) / 4).

Modules and weights: `VoxtralAudioTower` (Whisper encoder + multimodal projector),
`VoxtralAudioConfig.from_hf_config` (HF config object, dict or checkpoint directory), `MelConfig`,
`load_model` with `RULES` / `PARTITION_RULES`.
"""

from jaxsync.models.voxtral._config import (
    MelConfig as MelConfig,
    VoxtralAudioConfig as VoxtralAudioConfig,
)
from jaxsync.models.voxtral._entry import VoxtralAudioEncoder as VoxtralAudioEncoder
from jaxsync.models.voxtral._filters import (
    periodic_hann as periodic_hann,
    slaney_mel_filters as slaney_mel_filters,
)
from jaxsync.models.voxtral._mel import (
    LogMel as LogMel,
    MelSpec as MelSpec,
    log_mel_floor as log_mel_floor,
    log_mel_rows as log_mel_rows,
    log_mel_spectrogram as log_mel_spectrogram,
)
from jaxsync.models.voxtral._mel_plan import (
    FloorMode as FloorMode,
    MelMeta as MelMeta,
    MelPlan as MelPlan,
    num_stft_frames as num_stft_frames,
    plan_log_mel as plan_log_mel,
)
from jaxsync.models.voxtral._modules import (
    VoxtralAudioTower as VoxtralAudioTower,
    forward as forward,
    forward_waveforms as forward_waveforms,
    server_form as server_form,
)
from jaxsync.models.voxtral._plan import (
    VoxtralMeta as VoxtralMeta,
    VoxtralPlan as VoxtralPlan,
    plan as plan,
)
from jaxsync.models.voxtral._waveform_plan import (
    VoxtralWaveformMeta as VoxtralWaveformMeta,
    VoxtralWaveformPlan as VoxtralWaveformPlan,
    WaveformBuckets as WaveformBuckets,
    plan_waveforms as plan_waveforms,
)
from jaxsync.models.voxtral._weights import (
    PARTITION_RULES as PARTITION_RULES,
    RULES as RULES,
    SELECT as SELECT,
    load_model as load_model,
)
