"""Chameleon's sync-free image paths (vLLM PR #51458, `models/chameleon.py`).

Host entry points:
  ChameleonImageEncoder(model, **options) - pixels -> VQ codes -> BPE image-token ids -> their
                              text embedding rows (`jaxsync.Embeddings`, ids in extras["ids"]),
                              plus the text-side paths below; `load_state` for new weights.
  ChameleonTextPaths(cfg)   - from the config alone: the image-token logit mask, masked logits,
                              the `<image>` placeholder merge, and the device tables
                              (`mask_column`, `img2bpe_table`) for a server's own step.
Loading and config:
  load_model, ChameleonImageTower, PARTITION_RULES, weight_rules, ChameleonConfig,
  ChameleonVQConfig, from_hf_config.
Planner (host numpy; `jaxsync.upload_packed(plan)` moves `plan.meta` in one transfer):
  plan, ChameleonPlan, ChameleonMeta, IMAGE_BUCKETS, plan_merge, ChameleonMergePlan,
  placeholder_positions.
Pure functions for a server's own jitted step or `shard_map` (tables passed in or closed over;
no extra jit argument, no host callback):
  forward(model, pixels, meta)             -> jaxsync.Encoded: rows [Bp*T, D], finite [Bp],
                                              extras {"ids": [Bp*T]}
  img2bpe(codes, table)                    -> BPE ids (table: `img2bpe_table()`)
  mask_image_logits(logits, mask_column)   -> masked logits (mask: `mask_column(V)`)
  compute_logits(hidden, lm_head_weight, mask_column)
  merge_image_tokens(text_embeds, image_embeds, positions)  (positions: `plan_merge`)
Modules and vocabulary: ChameleonVQVAE, ImageVocabularyMapping, decode_image_token_name.
"""

from jaxsync.models.chameleon._config import (
    ChameleonConfig as ChameleonConfig,
    ChameleonVQConfig as ChameleonVQConfig,
    from_hf_config as from_hf_config,
)
from jaxsync.models.chameleon._entry import ChameleonImageEncoder as ChameleonImageEncoder
from jaxsync.models.chameleon._logits import (
    compute_logits as compute_logits,
    mask_image_logits as mask_image_logits,
)
from jaxsync.models.chameleon._merge import merge_image_tokens as merge_image_tokens
from jaxsync.models.chameleon._modules import (
    ChameleonImageTower as ChameleonImageTower,
    ChameleonVQVAE as ChameleonVQVAE,
    forward as forward,
    forward_encoder_only as forward_encoder_only,
)
from jaxsync.models.chameleon._plan import (
    IMAGE_BUCKETS as IMAGE_BUCKETS,
    ChameleonMergeMeta as ChameleonMergeMeta,
    ChameleonMergePlan as ChameleonMergePlan,
    ChameleonMeta as ChameleonMeta,
    ChameleonPlan as ChameleonPlan,
    placeholder_positions as placeholder_positions,
    plan as plan,
    plan_merge as plan_merge,
)
from jaxsync.models.chameleon._text import ChameleonTextPaths as ChameleonTextPaths
from jaxsync.models.chameleon._vocab import (
    ImageVocabularyMapping as ImageVocabularyMapping,
    decode_image_token_name as decode_image_token_name,
    img2bpe as img2bpe,
)
from jaxsync.models.chameleon._weights import (
    PARTITION_RULES as PARTITION_RULES,
    load_model as load_model,
    weight_rules as weight_rules,
)
