"""Host planning for Chameleon's image paths: numpy only, no device work.

`plan` buckets an image batch (the tower's per-call metadata: which rows are real images, and
the VQ code -> BPE id table); `plan_merge` turns a prompt's `<image>` placeholders into padded
scatter positions. Both validate host metadata before anything is uploaded or compiled, and
both return a typed `meta` that goes up in ONE `jaxsync.upload_packed(plan)` (a server may put
its fields, `meta._asdict()`, in its own packed transfer instead).
`images_planner` is the entry's planner; `bucket_batch_sizes` lists the batch sizes that share
one bucket's program.
"""

from __future__ import annotations

import collections
import math
from typing import Any, NamedTuple

import numpy as np

import jaxsync
from jaxsync._host import host_int, host_ints
from jaxsync.models.chameleon._config import ChameleonConfig
from jaxsync.models.chameleon._vocab import ImageVocabularyMapping


IMAGE_BUCKETS: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256)
"""Default image-count buckets: one image alone (the common prompt), then 2..4 share a program,
and so on. Every image has the processor's one size (`resolution`), so this is the only pad."""


class ChameleonMeta(NamedTuple):
    """The device metadata of one image batch (`jaxsync.upload_packed(plan)` moves it).

    Attributes:
      valid: bool [Bp], True for the real images.
      img2bpe: int32 [N] VQ code -> BPE id, N the codebook size.
    """

    valid: np.ndarray
    img2bpe: np.ndarray


class ChameleonPlan(NamedTuple):
    """Host plan of one image batch.

    Attributes:
      meta: the device metadata.
      lengths: output rows per image (`tokens_per_image` each).
      num_images: real images.
      rows: padded image count Bp (a bucket, a multiple of the batch shards).
      tokens_per_image: T, rows per image.
    """

    meta: ChameleonMeta
    lengths: tuple[int, ...]
    num_images: int
    rows: int
    tokens_per_image: int


def plan(
    num_images: int,
    cfg: ChameleonConfig,
    *,
    buckets: tuple[int, ...] | None = None,
    batch_shards: int = 1,
    missing_code_id: int | None = None,
) -> ChameleonPlan:
    """Plans a batch of `num_images` images for `forward`.

    Args:
      num_images: real images (host int).
      cfg: the model config (its vocabulary gives the code table).
      buckets: image-count buckets (default `IMAGE_BUCKETS`).
      batch_shards: devices the batch axis is split over: the padded count is a multiple of it,
        so every shard holds whole images.
      missing_code_id: see `ImageVocabularyMapping` (None: a VQ code without a name is an error).

    Raises:
      TypeError: a non-integer count. ValueError: no image, more than the largest bucket, or a
        codebook code without an image-token name.
    """
    n = host_int(num_images, name="num_images", minimum=1)
    shards = host_int(batch_shards, name="batch_shards", minimum=1)
    rows = jaxsync.bucket(n, IMAGE_BUCKETS if buckets is None else buckets)
    rows = -(-rows // shards) * shards
    table = vocabulary(cfg, missing_code_id).img2bpe
    t = cfg.vq.tokens_per_image
    meta = ChameleonMeta(valid=np.arange(rows) < n, img2bpe=table)
    return ChameleonPlan(meta, (t,) * n, n, rows, t)


def images_planner(cfg: ChameleonConfig, shards_of: Any, **options: Any):
    """The entry's planner: `(pixels, where) -> (plan key, plan build)` for a batch of
    `pixels.shape[0]` images split into `shards_of(pixels)` pieces, `options` as `plan`'s."""

    def planner(pixels: Any, where: Any):
        n, shards = pixels.shape[0], shards_of(pixels)
        return (n, shards, where), lambda: plan(n, cfg, batch_shards=shards, **options)

    return planner


_VOCABULARIES: collections.OrderedDict = collections.OrderedDict()


def vocabulary(cfg: ChameleonConfig, missing_code_id: int | None = None) -> ImageVocabularyMapping:
    """The image vocabulary of `cfg`, built once per config object (a few recent ones kept)."""
    key = (id(cfg), missing_code_id)
    hit = _VOCABULARIES.get(key)
    if hit is not None and hit[0] is cfg:
        _VOCABULARIES.move_to_end(key)
        return hit[1]
    mapping = ImageVocabularyMapping(
        cfg.vocabulary_map, num_embeddings=cfg.vq.num_embeddings, missing_code_id=missing_code_id
    )
    _VOCABULARIES[key] = (cfg, mapping)  # holds cfg: its id is not reused while cached
    while len(_VOCABULARIES) > 8:
        _VOCABULARIES.popitem(last=False)
    return mapping


def bucket_batch_sizes(rows: int, buckets: tuple[int, ...] | None, batch_shards: int) -> list[int]:
    """The batch sizes, ascending, whose bucket is `rows` (they share its program), keeping
    only multiples of `batch_shards` (a batch split over devices always holds a multiple)."""
    buckets = IMAGE_BUCKETS if buckets is None else buckets
    lo = rows
    while lo > 1 and jaxsync.bucket(lo - 1, buckets) == rows:
        lo -= 1
    return [n for n in range(lo, rows + 1) if n % batch_shards == 0]


def placeholder_positions(input_ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """Flat (row-major) indices of the `<image>` placeholders in host `input_ids`."""
    ids = host_ints(input_ids, name="input_ids", ndim=None, minimum=None)
    return np.flatnonzero(ids.reshape(-1) == image_token_id).astype(np.int32)


class ChameleonMergeMeta(NamedTuple):
    """The device metadata of one merge.

    Attributes:
      positions: int32 [P], `P = bucket(num_image_tokens)`: flat row-major placeholder rows;
        padded slots hold the text row count (one past the end), which the scatter drops.
    """

    positions: np.ndarray


class ChameleonMergePlan(NamedTuple):
    """Scatter positions of one prompt batch.

    Attributes:
      meta: the device metadata (`jaxsync.upload_packed(plan)`).
      num_image_tokens: placeholders filled (host int).
    """

    meta: ChameleonMergeMeta
    num_image_tokens: int


def plan_merge(
    text_shape: tuple[int, ...],
    image_rows: int,
    *,
    input_ids=None,
    image_token_id: int | None = None,
    positions=None,
    num_image_tokens: int | None = None,
) -> ChameleonMergePlan:
    """Checks and pads the placeholder positions of a merge (see `merge_image_tokens`).

    Args:
      text_shape: `text_embeds.shape[:-1]` (`[S]` or `[B, S]`).
      image_rows: rows of the image embeddings (`N * T` or `M`), bucket padding included.
      input_ids: host ids shaped `text_shape` (with `image_token_id`), or
      positions: host flat row-major placeholder indices.
      num_image_tokens: leading image rows that are real (default: all).

    Raises:
      TypeError: floats or bools for ids, positions or counts. ValueError: counts that
        disagree, positions out of range or repeated, shapes that disagree.
    """
    if (positions is None) == (input_ids is None):
        raise ValueError("pass exactly one of input_ids (with image_token_id) or positions")
    total = math.prod(text_shape)
    if input_ids is not None:
        if image_token_id is None:
            raise ValueError("input_ids needs image_token_id")
        ids = host_ints(input_ids, name="input_ids", ndim=None, minimum=None)
        if ids.shape != tuple(text_shape):
            raise ValueError(f"input_ids shape {ids.shape} != {tuple(text_shape)}")
        pos = placeholder_positions(ids, image_token_id).astype(np.int64)
    else:
        pos = host_ints(positions, name="positions", ndim=None, minimum=None).reshape(-1)
    n = image_rows if num_image_tokens is None else num_image_tokens
    n = host_int(n, name="num_image_tokens", minimum=0)
    if n > image_rows:
        raise ValueError(f"num_image_tokens={n} but image_embeds holds {image_rows} rows")
    if pos.size != n:
        raise ValueError(
            f"image placeholders and image tokens do not match: {pos.size} placeholder "
            f"position(s) but {n} image token embedding(s)"
        )
    if n and (pos.min() < 0 or pos.max() >= total):
        raise ValueError(f"placeholder positions must lie in [0, {total})")
    if np.unique(pos).size != n:
        raise ValueError("placeholder positions repeat")
    padded = np.full((jaxsync.bucket(n),), total, dtype=np.int32)  # out of range -> dropped
    padded[:n] = pos
    return ChameleonMergePlan(ChameleonMergeMeta(padded), n)
