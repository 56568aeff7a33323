"""Host planning for Chameleon's image paths: numpy only, no device work.

`plan_images` buckets an image batch (the tokenizer's per-call metadata); `plan_merge` turns a
prompt's `<image>` placeholders into padded scatter positions. Both validate host metadata
before anything is uploaded or compiled, and both return `fields` that go up in ONE
`jaxsync.upload_packed` (a server may upload them inside its own packed transfer instead).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import jaxsync


@dataclasses.dataclass(frozen=True)
class ChameleonImagePlan:
    """One image batch, bucketed.

    Attributes:
      num_images: real images (host int).
      rows: padded batch rows (`>= num_images`, a multiple of the batch shards).
      fields: `{"valid": bool [rows]}` (True for real images), for `jaxsync.upload_packed`.
    """

    num_images: int
    rows: int
    fields: dict[str, np.ndarray]


def plan_images(
    num_images: int, buckets: tuple[int, ...] | None = None, *, batch_shards: int = 1
) -> ChameleonImagePlan:
    """Buckets `num_images` images, padded to a multiple of `batch_shards` (the number of
    devices the batch axis is split over, so every shard holds whole images).

    Raises:
      TypeError: a non-integer count. ValueError: no image, or more than the largest bucket.
    """
    n = jaxsync.host_int(num_images, name="num_images", minimum=1)
    shards = jaxsync.host_int(batch_shards, name="batch_shards", minimum=1)
    rows = jaxsync.bucket(n, buckets, minimum=1)
    rows = -(-rows // shards) * shards
    return ChameleonImagePlan(n, rows, {"valid": np.arange(rows) < n})


def placeholder_positions(input_ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """Flat (row-major) indices of the `<image>` placeholders in host `input_ids`."""
    ids = jaxsync.host_ints(input_ids, name="input_ids", ndim=None, minimum=None)
    return np.flatnonzero(ids.reshape(-1) == image_token_id).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class ChameleonMergePlan:
    """Scatter positions of one prompt batch.

    Attributes:
      num_image_tokens: placeholders filled (host int).
      fields: `{"positions": int32 [P]}`, `P = bucket(num_image_tokens)`; padded slots hold
        `text rows` (one past the end), which the scatter drops.
    """

    num_image_tokens: int
    fields: dict[str, np.ndarray]


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
        ids = jaxsync.host_ints(input_ids, name="input_ids", ndim=None, minimum=None)
        if ids.shape != tuple(text_shape):
            raise ValueError(f"input_ids shape {ids.shape} != {tuple(text_shape)}")
        pos = placeholder_positions(ids, image_token_id).astype(np.int64)
    else:
        pos = jaxsync.host_ints(positions, name="positions", ndim=None, minimum=None).reshape(-1)
    n = image_rows if num_image_tokens is None else num_image_tokens
    n = jaxsync.host_int(n, name="num_image_tokens", minimum=0)
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
    return ChameleonMergePlan(n, {"positions": padded})
