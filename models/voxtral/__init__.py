"""Voxtral audio path (vLLM PR #51458, paths.md §4), sync-free in JAX.

* `log_mel_spectrogram`: on-device Whisper log-mel front end (periodic Hann, n_fft 400, hop 160,
  centre-reflect STFT, last frame dropped, Slaney filters, log10, dynamic-range floor in the three
  upstream variants, (x + 4) / 4) over a padded batch with host-side lengths.
* `VoxtralAudioModel` / `VoxtralAudioEmbedder`: the Whisper-style audio encoder and the multimodal
  projector; waveform -> mel -> encoder -> projector as one jitted call.
* `load_voxtral_audio`: `audio_tower.*` / `multi_modal_projector.*` weights through jaxsync.weights.
"""

from jaxsync.models.voxtral._config import (
    MelConfig as MelConfig,
    VoxtralAudioConfig as VoxtralAudioConfig,
)
from jaxsync.models.voxtral._filters import (
    periodic_hann as periodic_hann,
    slaney_mel_filters as slaney_mel_filters,
)
from jaxsync.models.voxtral._mel import (
    FloorMode as FloorMode,
    LogMel as LogMel,
    log_mel_spectrogram as log_mel_spectrogram,
)
from jaxsync.models.voxtral._model import (
    AudioEmbeddings as AudioEmbeddings,
    VoxtralAudioEmbedder as VoxtralAudioEmbedder,
    VoxtralAudioModel as VoxtralAudioModel,
)
from jaxsync.models.voxtral._weights import (
    RULES as RULES,
    load_voxtral_audio as load_voxtral_audio,
)
