"""jaxsync.models.qwen3_omni: the Qwen3-Omni audio encoder with host-planned chunking.

The per-audio mel lengths are host metadata: chunking, attention windows and the output gather are
planned in numpy (`plan`), uploaded in one packed transfer, and the encoder runs as one compiled
program per (frame, window, item) bucket. Nothing is read back from the device.

Server form (inside the server's own jit, over its own state leaves):

    p = plan(feature_lens, cfg)                       # host; features padded to p.num_frames
    meta = jaxsync.upload_packed(p)                   # one transfer
    encoded = forward(nnx.merge(graphdef, state), features, meta)   # jaxsync.Encoded
    # audio a: encoded.rows[o_a : o_a + p.lengths[a]], encoded.finite[a]

Public API:
  Qwen3OmniAudioEncoder   - host entry: `encoder(features, feature_lens)` or
                            `encoder(input_features=..., feature_attention_mask=...)` (the
                            processor's outputs) -> `jaxsync.Embeddings` (+ `extras["finite"]`).
  load_model, PARTITION_RULES - the tower from a checkpoint (dtype kept or cast, mesh placement).
  Qwen3OmniAudioConfig    - the config (`from_hf_config`: HF object, dict or directory).
  Qwen3OmniAudioTower, forward - the NNX module (`.cfg`; `.layers` a `jaxsync.LayerStack`) and
                            its pure forward -> `jaxsync.Encoded`.
  plan, Qwen3OmniPlan, Qwen3OmniMeta, Qwen3OmniBuckets - the host planner; `plan.meta` goes up
                            in one `jaxsync.upload_packed(plan)`, `plan.lengths` are the rows.
  features_from_processor - the processor's [B, F, T] + [B, T] mask as `(features, lens)`.
  pad_features, frame_bucket, FRAME_BUCKETS, WINDOW_BUCKETS, ITEM_BUCKETS - shape buckets.
  feat_extract_output_lengths, conv3_out_len, TOKENS_PER_FULL_CHUNK, sinusoid_table - the
                            upstream formulas and constants.
  audio_rules, find_prefix, PREFIXES - the checkpoint key mapping.
"""

from jaxsync.models.qwen3_omni._config import (
    TOKENS_PER_FULL_CHUNK as TOKENS_PER_FULL_CHUNK,
    Qwen3OmniAudioConfig as Qwen3OmniAudioConfig,
    conv3_out_len as conv3_out_len,
)
from jaxsync.models.qwen3_omni._entry import Qwen3OmniAudioEncoder as Qwen3OmniAudioEncoder
from jaxsync.models.qwen3_omni._features import (
    FRAME_BUCKETS as FRAME_BUCKETS,
    ITEM_BUCKETS as ITEM_BUCKETS,
    WINDOW_BUCKETS as WINDOW_BUCKETS,
    check_feature_lens as check_feature_lens,
    feat_extract_output_lengths as feat_extract_output_lengths,
    features_from_processor as features_from_processor,
    frame_bucket as frame_bucket,
    pad_features as pad_features,
)
from jaxsync.models.qwen3_omni._modules import (
    AudioAttention as AudioAttention,
    AudioEncoderLayer as AudioEncoderLayer,
    Qwen3OmniAudioTower as Qwen3OmniAudioTower,
    forward as forward,
    sinusoid_table as sinusoid_table,
)
from jaxsync.models.qwen3_omni._plan import (
    Qwen3OmniBuckets as Qwen3OmniBuckets,
    Qwen3OmniMeta as Qwen3OmniMeta,
    Qwen3OmniPlan as Qwen3OmniPlan,
    plan as plan,
)
from jaxsync.models.qwen3_omni._weights import (
    PARTITION_RULES as PARTITION_RULES,
    PREFIXES as PREFIXES,
    audio_rules as audio_rules,
    find_prefix as find_prefix,
    load_model as load_model,
)
