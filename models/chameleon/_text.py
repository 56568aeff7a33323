# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Chameleon's text-side paths: what needs the image vocabulary but not the image tower.

`ChameleonTextPaths(cfg)` is built from the model config alone: device tables for a server's own
jitted step (`mask_column`, `img2bpe_table`), and the standalone entry points on the language
model's tensors: the image-token logit mask, logits with the mask, and the `<image>` placeholder
merge, each one jitted call with its tables from the mapping's `DeviceCache`.
`ChameleonImageEncoder` offers the same paths beside the image tower.
"""

from __future__ import annotations

import jax
import numpy as np
from jaxtyping import Array, Float

import jaxsync
import jaxsync.check
from jaxsync import replicated_near
from jaxsync.models.chameleon import _logits, _merge
from jaxsync.models.chameleon._config import ChameleonConfig
from jaxsync.models.chameleon._plan import plan_merge
from jaxsync.models.chameleon._vocab import ImageVocabularyMapping


class ChameleonTextPaths:
    """Logit mask, masked logits and placeholder merge of one Chameleon model's image vocabulary.

    Args:
      cfg: the model config (its `vocabulary_map` and codebook size).
      missing_code_id: see `ImageVocabularyMapping` (None: `img2bpe_table` refuses a VQ code
        without a name; the mask and the merge need only the image-token ids).
      cache: the `DeviceCache` for the constant tables (default: the process-wide one).

    Attributes:
      cfg: the config.
      mapping: the image vocabulary (`ImageVocabularyMapping`).

    >>> import jax.numpy as jnp
    >>> from jaxsync.harness.paths.chameleon import reference as ref
    >>> text = ChameleonTextPaths(ChameleonConfig.from_hf_config(ref.tiny_hf_config()))
    >>> logits = text.mask_image_logits(jnp.zeros((2, text.cfg.vocab_size)))
    >>> bool(logits[0, text.mapping.image_token_ids[0]] == jnp.finfo(jnp.float32).min)
    True
    """

    def __init__(
        self,
        cfg: ChameleonConfig,
        *,
        missing_code_id: int | None = None,
        cache: jaxsync.DeviceCache | None = None,
    ):
        if not isinstance(cfg, ChameleonConfig):
            raise TypeError(f"cfg must be a ChameleonConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.mapping = ImageVocabularyMapping(
            cfg.vocabulary_map,
            num_embeddings=cfg.vq.num_embeddings,
            missing_code_id=missing_code_id,
            cache=cache,
        )

    # ------------------------------------------------------------ tables for a server's step

    def mask_column(self, vocab_size: int, placement=None) -> jax.Array:
        """bool `[vocab_size]` device mask of the image columns (cached): `mask_image_logits`."""
        return self.mapping.image_token_mask_on(vocab_size, placement)

    def img2bpe_table(self, placement=None) -> jax.Array:
        """int32 `[num_codes]` device VQ code -> BPE id table (cached), for `img2bpe`."""
        return self.mapping.img2bpe_on(placement)

    # ------------------------------------------------------------ logits and merge

    @jaxsync.check.entry_point
    def mask_image_logits(
        self, logits: Float[Array, "*B T V"], *, donate: bool = False
    ) -> Float[Array, "*B T V"]:
        """Every image-token column of `[T, V]` / `[B, T, V]` logits set to `finfo.min`.

        `donate=True` fills in place (the input is deleted; passing it again is a ValueError).
        """
        _logits.check_logits(logits, self.mapping.max_image_id)
        mask = self.mask_column(logits.shape[-1], replicated_near(logits))
        return (_logits.mask_jit_donated if donate else _logits.mask_jit)(logits, mask)

    @jaxsync.check.entry_point
    def compute_logits(
        self, hidden: Float[Array, "*B T D"], lm_head_weight: Float[Array, "V D"]
    ) -> Float[Array, "*B T V"]:
        """`hidden @ lm_head_weight.T` with the image tokens masked, in one jitted program."""
        _logits.check_lm_head(hidden, lm_head_weight, self.mapping.max_image_id)
        mask = self.mask_column(lm_head_weight.shape[0], replicated_near(hidden))
        return _logits.compute_logits_jit(hidden, lm_head_weight, mask)

    @jaxsync.check.entry_point
    def merge_image_embeddings(
        self,
        text_embeds: Float[Array, "*B S D"],
        image_embeds: Float[Array, "*N T D"],
        *,
        input_ids=None,
        positions=None,
        num_image_tokens: int | None = None,
        donate: bool = False,
    ) -> Float[Array, "*B S D"]:
        """Writes image-token embeddings, in order, at the `<image>` placeholders.

        Args:
          text_embeds: `[S, D]` or `[B, S, D]` device embeddings of the prompt.
          image_embeds: `[N, T, D]` or `[M, D]` device image-token embeddings (may be padded).
          input_ids: host ids shaped like `text_embeds.shape[:-1]`, or
          positions: host flat row-major placeholder indices.
          num_image_tokens: leading rows of `image_embeds` that are real (default: all).
          donate: donate `text_embeds` so the merge happens in place.

        Raises:
          TypeError / ValueError: see `plan_merge`; device arrays that are not live.
        """
        _merge.check_embeds(text_embeds, image_embeds, input_ids, positions)
        if input_ids is not None and self.mapping.image_token_id is None:
            raise ValueError("the vocabulary has no <image> token; pass positions instead")
        plan = plan_merge(
            text_embeds.shape[:-1],
            int(np.prod(image_embeds.shape[:-1])),
            input_ids=input_ids,
            image_token_id=self.mapping.image_token_id,
            positions=positions,
            num_image_tokens=num_image_tokens,
        )
        if plan.num_image_tokens == 0:
            return text_embeds
        pos = jaxsync.async_h2d(plan.meta.positions, placement=replicated_near(text_embeds))
        merge = _merge.merge_jit_donated if donate else _merge.merge_jit
        return merge(text_embeds, image_embeds, pos)
