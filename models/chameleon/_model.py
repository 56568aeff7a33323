# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""`ChameleonImagePaths`: the sync-free Chameleon image paths behind one host-side object."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

import jaxsync
import jaxsync.check
from jaxsync.models.chameleon._config import ChameleonConfig
from jaxsync.models.chameleon._logits import compute_logits, mask_image_logits
from jaxsync.models.chameleon._merge import merge_image_embeddings
from jaxsync.models.chameleon._tokenizer import ChameleonImageTokenizer
from jaxsync.models.chameleon._vocab import ImageVocabularyMapping
from jaxsync.models.chameleon._vqvae import ChameleonVQVAE
from jaxsync.models.chameleon._weights import load_vqvae


class ChameleonImagePaths:
    """Image vocabulary, image tokenizer, logit mask and embedding merge of one Chameleon model.

    Args:
      cfg: the model config.
      vqvae: the loaded VQ-VAE; None builds the text-side paths only (mask, logits, merge).
      missing_code_id: see `ImageVocabularyMapping` (None: a VQ code without a name is an error).
      cache: the `DeviceCache` for the constant tables (default: the process-wide one).
      buckets: image batch buckets for the tokenizer (default: powers of two).
      placement: where the tokenizer runs (None: default device).

    >>> from jaxsync.models.chameleon import _reference as ref
    >>> cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config())
    >>> paths = ChameleonImagePaths(cfg)
    >>> logits = paths.mask_image_logits(jnp.zeros((2, cfg.vocab_size)))
    >>> bool(logits[0, paths.mapping.image_token_ids[0]] == jnp.finfo(jnp.float32).min)
    True
    """

    def __init__(
        self,
        cfg: ChameleonConfig,
        vqvae: ChameleonVQVAE | None = None,
        *,
        missing_code_id: int | None = None,
        cache: jaxsync.DeviceCache | None = None,
        buckets: tuple[int, ...] | None = None,
        placement: jax.Device | jax.sharding.Sharding | None = None,
    ):
        self.cfg = cfg
        self.mapping = ImageVocabularyMapping(
            cfg.vocabulary_map,
            num_embeddings=cfg.vq.num_embeddings,
            missing_code_id=missing_code_id,
            cache=cache,
        )
        self.tokenizer = None
        if vqvae is not None:
            if vqvae.cfg != cfg.vq:
                raise ValueError("vqvae was built from a different vq config")
            self.tokenizer = ChameleonImageTokenizer(
                vqvae, self.mapping, buckets=buckets, placement=placement
            )

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype=jnp.bfloat16, **kwargs
    ) -> ChameleonImagePaths:
        """Reads `config.json` and the `model.vqmodel.*` weights of a checkpoint directory."""
        cfg = ChameleonConfig.from_hf_config(path)
        return cls(cfg, load_vqvae(cfg.vq, path, dtype=dtype), **kwargs)

    @jaxsync.check.entry_point
    def get_image_tokens(self, pixel_values: np.ndarray | jax.Array) -> Int[Array, "B T"]:
        """See `ChameleonImageTokenizer.get_image_tokens`."""
        if self.tokenizer is None:
            raise ValueError("built without a VQ-VAE: pass vqvae= to tokenize images")
        return self.tokenizer.get_image_tokens(pixel_values)

    @jaxsync.check.entry_point
    def mask_image_logits(
        self, logits: Float[Array, "*B T V"], *, donate: bool = False
    ) -> Float[Array, "*B T V"]:
        """See `mask_image_logits`; `donate=True` fills in place."""
        return mask_image_logits(logits, self.mapping, donate=donate)

    @jaxsync.check.entry_point
    def compute_logits(
        self, hidden: Float[Array, "*B T D"], lm_head_weight: Float[Array, "V D"]
    ) -> Float[Array, "*B T V"]:
        """See `compute_logits`."""
        return compute_logits(hidden, lm_head_weight, self.mapping)

    @jaxsync.check.entry_point
    def merge_image_embeddings(
        self,
        text_embeds: Float[Array, "*B S D"],
        image_embeds: Float[Array, "*N T D"],
        *,
        input_ids: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        num_image_tokens: int | None = None,
        donate: bool = False,
    ) -> Float[Array, "*B S D"]:
        """See `merge_image_embeddings` (the placeholder id comes from the vocabulary)."""
        if input_ids is not None and self.mapping.image_token_id is None:
            raise ValueError("the vocabulary has no <image> token; pass positions instead")
        return merge_image_embeddings(
            text_embeds,
            image_embeds,
            input_ids=input_ids,
            image_token_id=self.mapping.image_token_id,
            positions=positions,
            num_image_tokens=num_image_tokens,
            donate=donate,
        )
