"""The Chameleon image vocabulary: VQ code <-> BPE id tables, built once on the host.

Upstream (HF / vLLM `ChameleonImageVocabularyMapping`) derives the tables lazily from the
tokenizer's `vocabulary_map`. Two of its behaviours are silent and wrong, and are errors here:
a VQ code without an `IMGIMG` name maps to BPE id 0, and two names decoding to the same code
let the later one win. The device copies live in a `jaxsync.DeviceCache`, one per placement.

`img2bpe(codes, table)` is the code -> BPE gather as a pure function for a server's own jitted
step or `shard_map`, with `table = mapping.img2bpe_on(placement)` passed in (or closed over): it
adds no jit argument besides the table and no host callback. Codes are clamped into the table
(`mode="clip"`): they come from an argmin over the codebook, so the clamp never changes a real
code, and it replaces upstream's device-side assert with a gather that cannot fault.
`ImageVocabularyMapping.convert_img2bpe(codes)` is the standalone entry point (one jitted call).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

import jaxsync
from jaxsync import replicated_near
from jaxsync._host import host_int


Placement = jax.Device | jax.sharding.Sharding | None
IMAGE_PREFIX = "IMGIMG"
_LETTER_DIGITS = {chr(ord("A") + i): str(i) for i in range(10)}


def decode_image_token_name(name: str) -> int:
    """VQ code of an `IMGIMG` token name, decoded as upstream does.

    The prefix and the last character are dropped and the letters A..J become digits 0..9
    (other characters are kept), then the string is parsed as an integer.

    >>> decode_image_token_name("IMGIMGBAZ")
    10

    Raises:
      ValueError: the name does not decode to a non-negative integer.
    """
    body = "".join(_LETTER_DIGITS.get(c, c) for c in name[len(IMAGE_PREFIX) : -1])
    try:
        code = int(body)
    except ValueError:
        raise ValueError(f"image token name {name!r} does not decode to an integer") from None
    if code < 0:
        raise ValueError(f"image token name {name!r} decodes to a negative code {code}")
    return code


def img2bpe(codes: Int[Array, "*S"], table: Int[Array, " N"]) -> Int[Array, "*S"]:
    """BPE ids of VQ `codes` (any shape): `table[codes]`, codes clamped into the table (pure)."""
    return jnp.take(table, codes, axis=0, mode="clip")


_img2bpe = jax.jit(img2bpe)


def check_device_array(x, name: str) -> None:
    """`x` must be a live device array: host data or a donated (deleted) buffer is refused."""
    if not isinstance(x, jax.Array):
        raise TypeError(f"{name} must be a jax.Array on a device, got {type(x).__name__}")
    if not isinstance(x, jax.core.Tracer) and x.is_deleted():
        raise ValueError(
            f"{name} was deleted (donated to an earlier call, e.g. donate=True): pass the "
            "array that call returned"
        )


class ImageVocabularyMapping:
    """Host tables mapping VQ codes to BPE ids and back, plus their cached device copies.

    Args:
      vocab_map: tokenizer token -> id map (`ChameleonConfig.vocabulary_map`).
      num_embeddings: the VQ codebook size. Codes `0..num_embeddings-1` must all have a name
        for the code table unless `missing_code_id` is given. None: `max(code) + 1`.
      missing_code_id: the BPE id a code without a name maps to. None (default) makes a missing
        code an error where the code table is used. Upstream uses 0 silently; pass 0 to
        reproduce it, deliberately.
      cache: where the device copies live.

    Attributes:
      image_token_ids: int32 `[K]`, the sorted BPE ids of every `IMGIMG` token.
      img2bpe: int32 `[num_codes]`, VQ code -> BPE id (reading it raises `ValueError` while a
        code has no name and `missing_code_id` is None).
      bpe2img: dict BPE id -> VQ code.
      missing_codes: the codebook's codes that have no name.
      image_token_id: the `<image>` placeholder id, or None.
      max_image_id: the largest image BPE id (logits must be wider than this).

    A name whose code lies outside the codebook is still an image token (masked and merged as
    any other), but no VQ code produces it, so the code table leaves it out; upstream sizes its
    table by the largest name instead, with the same entries for every code the VQ produces.
    The logit mask and the merge need only the image token ids, so they work with a code table
    that has gaps; the tokenizer and `img2bpe` refuse it.

    Raises:
      TypeError: a non-integer id.
      ValueError: no `IMGIMG` token, an undecodable name, or two names with one code.
    """

    def __init__(
        self,
        vocab_map: Mapping[str, int],
        *,
        num_embeddings: int | None = None,
        missing_code_id: int | None = None,
        cache: jaxsync.DeviceCache | None = None,
    ):
        self._cache = jaxsync.default_cache if cache is None else cache
        image_token_id = vocab_map.get("<image>")
        if image_token_id is not None:
            image_token_id = host_int(image_token_id, name="<image> id", minimum=0)
        self.image_token_id = image_token_id
        if missing_code_id is not None:
            missing_code_id = host_int(missing_code_id, name="missing_code_id", minimum=0)
        named = sorted(
            (host_int(v, name=f"vocabulary_map[{k!r}]", minimum=0), k)
            for k, v in vocab_map.items()
            if k.startswith(IMAGE_PREFIX)
        )
        if not named:
            raise ValueError(f"vocabulary_map has no {IMAGE_PREFIX!r} image tokens")
        self.bpe2img: dict[int, int] = {}
        owner: dict[int, str] = {}
        for bpe, name in named:
            code = decode_image_token_name(name)
            if code in owner:
                raise ValueError(
                    f"image tokens {owner[code]!r} and {name!r} both decode to VQ code {code}"
                )
            owner[code] = name
            self.bpe2img[bpe] = code
        if num_embeddings is None:
            num_codes = max(owner) + 1
        else:
            num_codes = host_int(num_embeddings, name="num_embeddings", minimum=1)
        self.image_token_ids = np.array([b for b, _ in named], dtype=np.int32)
        self.max_image_id = int(self.image_token_ids[-1])
        table = np.full((num_codes,), -1, dtype=np.int64)
        for bpe, code in self.bpe2img.items():
            if code < num_codes:  # beyond the codebook: an image token no VQ code produces
                table[code] = bpe
        self.missing_codes = np.flatnonzero(table < 0)
        self._table_error = None
        if self.missing_codes.size and missing_code_id is None:
            shown = self.missing_codes[:8].tolist()
            self._table_error = (
                f"{self.missing_codes.size} VQ codes have no {IMAGE_PREFIX} name (first: "
                f"{shown}); upstream maps them silently to BPE id 0. Pass missing_code_id "
                "to choose their id explicitly."
            )
        elif self.missing_codes.size:
            table[self.missing_codes] = missing_code_id
        self._img2bpe = table.astype(np.int32)
        # Content-addressed names: two mappings with equal tables share one device copy.
        digest = hashlib.sha1(self._img2bpe.tobytes() + self.image_token_ids.tobytes())
        self._key = digest.hexdigest()[:16]

    def check_code_table(self) -> None:
        """Raises ValueError when a codebook code has no name and `missing_code_id` is None."""
        if self._table_error is not None:
            raise ValueError(self._table_error)

    @property
    def img2bpe(self) -> np.ndarray:
        """int32 `[num_codes]` VQ code -> BPE id (after `check_code_table`)."""
        self.check_code_table()
        return self._img2bpe

    @property
    def num_codes(self) -> int:
        """Length of the `img2bpe` table (the codebook size)."""
        return int(self._img2bpe.shape[0])

    def img2bpe_on(self, placement: Placement = None) -> jax.Array:
        """Device copy of `img2bpe` at `placement` (built once, then cached)."""
        return self._cache.get(f"chameleon.img2bpe.{self._key}", self.img2bpe, placement=placement)

    def convert_img2bpe(self, codes: Int[Array, "*S"]) -> Int[Array, "*S"]:
        """BPE ids of device VQ `codes` (one jitted call; the table is cached near `codes`).

        Raises:
          TypeError: host codes or a non-integer dtype. ValueError: a deleted (donated) array.
        """
        check_device_array(codes, "codes")
        if not jnp.issubdtype(codes.dtype, jnp.integer):
            raise TypeError(f"codes must be integers, got {codes.dtype}")
        return _img2bpe(codes, self.img2bpe_on(replicated_near(codes)))

    def image_token_mask(self, vocab_size: int) -> np.ndarray:
        """bool `[vocab_size]`: True at every image-token id (host)."""
        if vocab_size <= self.max_image_id:
            raise ValueError(
                f"vocab {vocab_size} does not cover the largest image token id {self.max_image_id}"
            )
        mask = np.zeros(vocab_size, np.bool_)
        mask[self.image_token_ids] = True
        return mask

    def image_token_mask_on(self, vocab_size: int, placement: Placement = None) -> jax.Array:
        """Device copy of `image_token_mask(vocab_size)` at `placement` (built once, cached)."""
        return self._cache.get(
            f"chameleon.image_mask.{self._key}.{vocab_size}",
            lambda: self.image_token_mask(vocab_size),
            placement=placement,
        )
