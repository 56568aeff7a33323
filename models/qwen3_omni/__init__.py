"""jaxsync.models.qwen3_omni: the Qwen3-Omni audio encoder with host-planned chunking.

The per-audio mel lengths are host metadata: chunking, attention windows and the output gather are
planned in numpy (`plan_chunks`), uploaded in one packed transfer, and the encoder runs as one
jitted program per (frame bucket, window bucket). Nothing is read back from the device.

Host time per call (H200, TFRT client, released size; docs/benchmarks.md): 0.09-0.13 ms when the
length mix was seen before (`AudioEncoder` caches 64 plans and their uploads), about 1.0 ms for
a new mix (the numpy plan and one packed upload; 0.99 against 1.25 ms before the direct upload).
"""

from jaxsync.models.qwen3_omni._config import (
    Qwen3OmniAudioConfig as Qwen3OmniAudioConfig,
    conv3_out_len as conv3_out_len,
)
from jaxsync.models.qwen3_omni._model import (
    AudioEmbeddings as AudioEmbeddings,
    AudioEncoder as AudioEncoder,
    pad_features as pad_features,
)
from jaxsync.models.qwen3_omni._modules import (
    AudioAttention as AudioAttention,
    AudioEncoderLayer as AudioEncoderLayer,
    Qwen3OmniAudioTower as Qwen3OmniAudioTower,
    sinusoid_table as sinusoid_table,
)
from jaxsync.models.qwen3_omni._plan import (
    FRAME_BUCKETS as FRAME_BUCKETS,
    WINDOW_BUCKETS as WINDOW_BUCKETS,
    ChunkPlan as ChunkPlan,
    check_feature_lens as check_feature_lens,
    feat_extract_output_lengths as feat_extract_output_lengths,
    frame_bucket as frame_bucket,
    plan_chunks as plan_chunks,
)
from jaxsync.models.qwen3_omni._weights import (
    PREFIXES as PREFIXES,
    audio_rules as audio_rules,
    find_prefix as find_prefix,
    load_audio_encoder as load_audio_encoder,
)
