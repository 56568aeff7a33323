"""jaxsync.models.glm4v: the GLM-4.1V vision tower with on-device bicubic position embeddings.

Three layers:
  plan(grid_thw, cfg) -> Glm4vPlan
                            - host numpy plan of a batch: `meta` (a `Glm4vMeta` of arrays, one
                              packed upload), `lengths` (merged rows per item), padded sizes.
  forward(model, pixels, meta) -> jaxsync.Encoded
                            - the pure forward of a `Glm4vVisionTower`, callable inside any jit
                              (weights are arguments): rows = merged tokens, finite [I],
                              extras {"hidden": the tokens before the merger}.
  Glm4vVisionEncoder        - the host entry: `encoder(pixel_values=..., image_grid_thw=...)`
                              with the image processor's outputs -> `jaxsync.Embeddings`.
Weights: `load_model(checkpoint, cfg=None, *, dtype=None, mesh=None,
partition_rules=PARTITION_RULES)`; `rules(cfg)` maps HF keys, `PARTITION_RULES` splits the tower's
matmuls over a "model" mesh axis.
"""

from jaxsync.models.glm4v._config import Glm4vVisionConfig as Glm4vVisionConfig
from jaxsync.models.glm4v._entry import Glm4vVisionEncoder as Glm4vVisionEncoder
from jaxsync.models.glm4v._interp import interpolate_pos_embed as interpolate_pos_embed
from jaxsync.models.glm4v._modules import (
    Glm4vTowerConfig as Glm4vTowerConfig,
    Glm4vVisionTower as Glm4vVisionTower,
    forward as forward,
    forward_encoder_only as forward_encoder_only,
    pos_embeds as pos_embeds,
)
from jaxsync.models.glm4v._plan import (
    DEFAULT_GROUP_BUCKETS as DEFAULT_GROUP_BUCKETS,
    DEFAULT_ITEM_BUCKETS as DEFAULT_ITEM_BUCKETS,
    DEFAULT_SEGMENT_BUCKETS as DEFAULT_SEGMENT_BUCKETS,
    Glm4vBuckets as Glm4vBuckets,
    Glm4vMeta as Glm4vMeta,
    Glm4vPlan as Glm4vPlan,
    merge_block_coords as merge_block_coords,
    plan as plan,
    resolve_layout as resolve_layout,
)
from jaxsync.models.glm4v._weights import (
    FULL_MODEL_PREFIX as FULL_MODEL_PREFIX,
    PARTITION_RULES as PARTITION_RULES,
    load_model as load_model,
    rules as rules,
)
