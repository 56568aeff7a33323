"""jaxsync.models.glm4v: the GLM-4.1V vision tower with on-device bicubic position embeddings.

Entry points take host `grid_thw`; all metadata derived from it is planned in numpy and uploaded
in one packed transfer, and the patch count is padded to a bucket so many image sizes share one
compiled program.
"""

from jaxsync.models.glm4v._config import Glm4vVisionConfig as Glm4vVisionConfig
from jaxsync.models.glm4v._interp import interpolate_pos_embed as interpolate_pos_embed
from jaxsync.models.glm4v._model import (
    Glm4vVisionEncoder as Glm4vVisionEncoder,
    Glm4vVisionModel as Glm4vVisionModel,
    VisionOutput as VisionOutput,
)
from jaxsync.models.glm4v._plan import (
    DEFAULT_GROUP_BUCKETS as DEFAULT_GROUP_BUCKETS,
    VisionPlan as VisionPlan,
    merge_block_coords as merge_block_coords,
    plan_batch as plan_batch,
)
from jaxsync.models.glm4v._weights import (
    FULL_MODEL_PREFIX as FULL_MODEL_PREFIX,
    RULES as RULES,
    load_vision_model as load_vision_model,
)
