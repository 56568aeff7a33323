"""Host planning for Chameleon's image paths: numpy only, no device work.

`plan_images` buckets an image batch (the tokenizer's per-call metadata); `plan_merge` turns a
prompt's `<image>` placeholders into padded scatter positions. Both validate host metadata
before anything is uploaded or compiled, and both return `fields` that go up in ONE
`jaxsync.upload_packed` (a server may upload them inside its own packed transfer instead).
`host_pixels` and `check_pixels` validate the tokenizer's input (device pixels by shape and
dtype only); `bucket_batch_sizes` lists the batch sizes that share one bucket's program.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

import jaxsync


_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))


def host_pixels(pixel_values) -> np.ndarray:
    """Host pixels (numpy or a torch CPU tensor) as numpy; float64 narrowed to float32."""
    x = jaxsync.host_array(pixel_values, name="pixel_values")
    if x.dtype == np.float64:  # numpy's default float: narrowed exactly as the model would
        x = x.astype(np.float32)
    return x


def check_pixels(x, image_shape: tuple[int, int, int]) -> int:
    """The number of images in `[B, *image_shape]` pixels (host or device: shape and dtype only).

    Raises:
      TypeError: a dtype other than float32/float16/bfloat16. ValueError: another shape, no image.
    """
    shape = tuple(x.shape)
    if len(shape) != 4 or shape[1:] != image_shape:
        raise ValueError(
            f"pixel_values must have shape (B, {', '.join(map(str, image_shape))}), got {shape}"
        )
    if np.dtype(x.dtype) not in _FLOATS:
        raise TypeError(f"pixel_values must be float32/float16/bfloat16, got {x.dtype}")
    if shape[0] < 1:
        raise ValueError("pixel_values holds no image")
    return shape[0]


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


def bucket_batch_sizes(rows: int, buckets: tuple[int, ...] | None, batch_shards: int) -> list[int]:
    """The batch sizes, ascending, whose bucket is `rows` (they share its program), keeping
    only multiples of `batch_shards` (a batch split over devices always holds a multiple)."""
    lo = rows
    while lo > 1 and jaxsync.bucket(lo - 1, buckets, minimum=1) == rows:
        lo -= 1
    return [n for n in range(lo, rows + 1) if n % batch_shards == 0]


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
