"""Gemma 3n audio path: audio tower, audio embedder, fixed-length padding and prompt merge.

Mirrors transformers' `Gemma3nAudioEncoder`, `Gemma3nMultimodalEmbedder` and the audio part of
`Gemma3nModel.forward` (vLLM `Gemma3nForConditionalGeneration._process_audio_input`), with the
padding-token embedding cached on the device and every host entry point sync-free.
"""

# Config
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig as Gemma3nAudioConfig

# Model
from jaxsync.models.gemma3n._encoder import (
    AudioEncoder as AudioEncoder,
    MultimodalEmbedder as MultimodalEmbedder,
)
from jaxsync.models.gemma3n._model import Gemma3nAudioModel as Gemma3nAudioModel

# Host entry points
from jaxsync.models.gemma3n._runtime import (
    AudioEmbedder as AudioEmbedder,
    AudioTruncationWarning as AudioTruncationWarning,
    merge_audio_embeddings as merge_audio_embeddings,
)

# Weights
from jaxsync.models.gemma3n._weights import (
    AUDIO_RULES as AUDIO_RULES,
    load_audio_model as load_audio_model,
)
