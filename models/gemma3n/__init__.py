"""Gemma 3n audio path: audio tower, audio embedder, fixed-length padding and prompt merge.

Mirrors transformers' `Gemma3nAudioEncoder`, `Gemma3nMultimodalEmbedder` and the audio part of
`Gemma3nModel.forward` (vLLM `Gemma3nForConditionalGeneration._process_audio_input`), every host
entry point sync-free.

Three layers:
  plan / Gemma3nPlan / Gemma3nMeta - host planning (numpy): frame mask, buckets
                                     (`Gemma3nBuckets`), row layout; host_features validates
                                     processor outputs.
  forward / encode                 - the pure forwards `forward(model, features, meta)` ->
                                     `jaxsync.Encoded`, called inside a server's jit with the
                                     weights as arguments (`encode`: the tower's encodings).
  Gemma3nAudioEncoder              - the host entry `Gemma3nAudioEncoder(model, **options)`:
                                     processor outputs in, `jaxsync.Embeddings` out
                                     (`soft_tokens` rows per clip), one dispatch per call.
Also: Gemma3nAudioConfig / from_hf_config, the NNX modules (Gemma3nAudioModel,
Gemma3nAudioTower, Gemma3nMultimodalEmbedder, ConformerBlock, ChunkedLocalAttention),
load_model / AUDIO_RULES / PARTITION_RULES, merge_audio_embeddings (placeholders of the prompt),
AudioTruncationWarning.
"""

# Modules, config and the pure forwards
from jaxsync.models.gemma3n._attention import ChunkedLocalAttention as ChunkedLocalAttention
from jaxsync.models.gemma3n._config import (
    Gemma3nAudioConfig as Gemma3nAudioConfig,
    from_hf_config as from_hf_config,
)

# Host entry points
from jaxsync.models.gemma3n._entry import Gemma3nAudioEncoder as Gemma3nAudioEncoder
from jaxsync.models.gemma3n._forward import encode as encode, forward as forward
from jaxsync.models.gemma3n._inputs import host_features as host_features
from jaxsync.models.gemma3n._modules import (
    ConformerBlock as ConformerBlock,
    Gemma3nAudioModel as Gemma3nAudioModel,
    Gemma3nAudioTower as Gemma3nAudioTower,
    Gemma3nMultimodalEmbedder as Gemma3nMultimodalEmbedder,
)

# Planning
from jaxsync.models.gemma3n._plan import (
    CLIP_BUCKETS as CLIP_BUCKETS,
    FRAME_BUCKETS as FRAME_BUCKETS,
    AudioTruncationWarning as AudioTruncationWarning,
    Gemma3nBuckets as Gemma3nBuckets,
    Gemma3nMeta as Gemma3nMeta,
    Gemma3nPlan as Gemma3nPlan,
    plan as plan,
)
from jaxsync.models.gemma3n._prompt import merge_audio_embeddings as merge_audio_embeddings

# Weights
from jaxsync.models.gemma3n._weights import (
    AUDIO_RULES as AUDIO_RULES,
    PARTITION_RULES as PARTITION_RULES,
    load_model as load_model,
)
