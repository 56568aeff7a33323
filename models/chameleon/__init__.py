"""Chameleon's sync-free image paths (vLLM PR #51458, `models/chameleon.py`).

The image vocabulary (VQ code <-> BPE id), the VQ-VAE image tokenizer (`get_image_tokens`), the
image-token logit mask (`mask_image_logits`, `compute_logits`) and the placeholder merge
(`merge_image_embeddings`), at parity with `transformers`' Chameleon.
"""

from jaxsync.models.chameleon._config import (
    ChameleonConfig as ChameleonConfig,
    ChameleonVQConfig as ChameleonVQConfig,
)
from jaxsync.models.chameleon._logits import (
    compute_logits as compute_logits,
    mask_image_logits as mask_image_logits,
)
from jaxsync.models.chameleon._merge import (
    merge_image_embeddings as merge_image_embeddings,
    placeholder_positions as placeholder_positions,
)
from jaxsync.models.chameleon._model import ChameleonImagePaths as ChameleonImagePaths
from jaxsync.models.chameleon._tokenizer import ChameleonImageTokenizer as ChameleonImageTokenizer
from jaxsync.models.chameleon._vocab import (
    ImageVocabularyMapping as ImageVocabularyMapping,
    decode_image_token_name as decode_image_token_name,
)
from jaxsync.models.chameleon._vqvae import ChameleonVQVAE as ChameleonVQVAE
from jaxsync.models.chameleon._weights import (
    VQ_RULES as VQ_RULES,
    load_vqvae as load_vqvae,
)
