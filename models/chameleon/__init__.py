"""Chameleon's sync-free image paths (vLLM PR #51458, `models/chameleon.py`).

Host entry point:
  ChameleonImageEncoder     - pixels -> VQ codes -> BPE image-token ids (`jaxsync.Embeddings`),
                              plus the image-token logit mask, masked logits and the `<image>`
                              placeholder merge, each one jitted call; `load_state` for new weights.
Loading and config:
  load_model, PARTITION_RULES, VQ_RULES, ChameleonConfig, ChameleonVQConfig, from_hf_config.
Planner (host numpy; `fields` go up in one `jaxsync.upload_packed`):
  plan_images, ChameleonImagePlan, plan_merge, ChameleonMergePlan, placeholder_positions.
Pure functions for a server's own jitted step or `shard_map` (tables passed in or closed over;
no extra jit argument, no host callback):
  forward(vq_model, pixels, meta)          -> (VQ codes [Bp, T], finite [Bp])
  img2bpe(codes, table)                    -> BPE ids (table: `encoder.img2bpe_table()`)
  mask_image_logits(logits, mask_column)   -> masked logits (mask: `encoder.mask_column(V)`)
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
from jaxsync.models.chameleon._modules import ChameleonVQVAE as ChameleonVQVAE, forward as forward
from jaxsync.models.chameleon._plan import (
    ChameleonImagePlan as ChameleonImagePlan,
    ChameleonMergePlan as ChameleonMergePlan,
    placeholder_positions as placeholder_positions,
    plan_images as plan_images,
    plan_merge as plan_merge,
)
from jaxsync.models.chameleon._vocab import (
    ImageVocabularyMapping as ImageVocabularyMapping,
    decode_image_token_name as decode_image_token_name,
    img2bpe as img2bpe,
)
from jaxsync.models.chameleon._weights import (
    PARTITION_RULES as PARTITION_RULES,
    VQ_RULES as VQ_RULES,
    load_model as load_model,
)
