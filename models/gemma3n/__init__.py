"""Gemma 3n audio path: audio tower, audio embedder, fixed-length padding and prompt merge.

Mirrors transformers' `Gemma3nAudioEncoder`, `Gemma3nMultimodalEmbedder` and the audio part of
`Gemma3nModel.forward` (vLLM `Gemma3nForConditionalGeneration._process_audio_input`), with the
padding-token embedding cached on the device and every host entry point sync-free.

Three layers:
  plan_audio / Gemma3nAudioPlan  - host planning (numpy): frame mask, buckets, row layout;
                                   host_features validates processor outputs.
  forward                        - the pure forward `forward(model, features, meta)`, callable
                                   inside a server's jit with the weights as arguments.
  Gemma3nAudioEncoder            - the host entry: processor outputs in, `jaxsync.Embeddings`
                                   out (`soft_tokens` rows per clip), one dispatch per call.
Also: Gemma3nAudioConfig / from_hf_config, the NNX modules (Gemma3nAudioModel,
Gemma3nAudioTower, Gemma3nMultimodalEmbedder, ConformerBlock, ChunkedLocalAttention),
load_model / AUDIO_RULES / PARTITION_RULES, merge_audio_embeddings (placeholders of the prompt),
AudioTruncationWarning.
"""

# Modules, config and the pure forward
from jaxsync.models.gemma3n._attention import ChunkedLocalAttention as ChunkedLocalAttention
from jaxsync.models.gemma3n._config import (
    Gemma3nAudioConfig as Gemma3nAudioConfig,
    from_hf_config as from_hf_config,
)

# Host entry points
from jaxsync.models.gemma3n._entry import (
    Gemma3nAudioEncoder as Gemma3nAudioEncoder,
    merge_audio_embeddings as merge_audio_embeddings,
)
from jaxsync.models.gemma3n._modules import (
    ConformerBlock as ConformerBlock,
    Gemma3nAudioModel as Gemma3nAudioModel,
    Gemma3nAudioTower as Gemma3nAudioTower,
    Gemma3nMultimodalEmbedder as Gemma3nMultimodalEmbedder,
    forward as forward,
)

# Planning
from jaxsync.models.gemma3n._plan import (
    AudioTruncationWarning as AudioTruncationWarning,
    Gemma3nAudioPlan as Gemma3nAudioPlan,
    host_features as host_features,
    plan_audio as plan_audio,
)

# Weights
from jaxsync.models.gemma3n._weights import (
    AUDIO_RULES as AUDIO_RULES,
    PARTITION_RULES as PARTITION_RULES,
    load_model as load_model,
)
