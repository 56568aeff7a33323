"""One input per bucket for each family's encoder: what `jaxsync.precompile` compiles it with.

A bucket is the family's main static size, and each input pads to exactly that bucket, so the
program it compiles is the one a later call in the bucket runs:

  Glm4vVisionEncoder     merged tokens of one image (`buckets.tokens`)
  Qwen3OmniAudioEncoder  mel frames of one audio (`buckets.frames`; a batch whose audios
                         split into another attention-window bucket compiles its own program)
  Gemma3nAudioEncoder    padded mel frames of one clip (`buckets.frames`; with a granularity
                         G, any multiple of G, and no default)
  VoxtralAudioEncoder    30 s windows of `input_features` (`chunk_buckets`; default 1, 2, 4, 8,
                         of the powers of two it pads to)
  ChameleonImageEncoder  images (`buckets`; default `IMAGE_BUCKETS`)

The inputs are host zeros (finite, of the encoder's dtypes and shapes); nothing is uploaded or
compiled here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np


class BucketInputs(NamedTuple):
    """How to compile one encoder per bucket.

    Attributes:
      default: the buckets compiled when none are given (the encoder's own).
      check: `(bucket) -> None`; raises `ValueError` for a size the encoder never pads to.
      make: `(bucket) -> (args, kwargs)`: the host input of exactly that bucket.
    """

    default: tuple[int, ...]
    check: Callable[[int], None]
    make: Callable[[int], tuple[tuple, dict]]


_VOXTRAL_DEFAULT = (1, 2, 4, 8)


def _one_of(name: str, allowed: Sequence[int], what: str) -> Callable[[int], None]:
    allowed = tuple(int(b) for b in allowed)

    def check(b: int) -> None:
        if b not in allowed:
            raise ValueError(f"bucket {b} is not one of {name}'s {what} buckets {allowed}")

    return check


def _glm4v(enc: Any) -> BucketInputs:
    cfg, m = enc.cfg, enc.cfg.spatial_merge_size

    def make(b: int) -> tuple[tuple, dict]:  # one [1, m, m*b] image: exactly b merged tokens
        pixels = np.zeros((m * m * b, cfg.patch_dim), getattr(enc, "dtype", np.float32))
        return (pixels, [[1, m, m * b]]), {}

    tokens = tuple(enc.buckets.tokens)
    return BucketInputs(tokens, _one_of(type(enc).__name__, tokens, "token"), make)


def _qwen3_omni(enc: Any) -> BucketInputs:
    frames = tuple(enc.buckets.frames)

    def make(b: int) -> tuple[tuple, dict]:  # one audio of b frames
        return (np.zeros((enc.cfg.num_mel_bins, b), np.float32), [b]), {}

    return BucketInputs(frames, _one_of(type(enc).__name__, frames, "frame"), make)


def _gemma3n(enc: Any) -> BucketInputs:
    frames = enc.buckets.frames

    def make(b: int) -> tuple[tuple, dict]:
        # One clip of the fewest frames that pad to b: the program is the bucket's, and a
        # short clip stays within the tower's `soft_tokens` where b frames might not.
        if isinstance(frames, int):
            s = b - frames + 1
        else:
            s = max((f for f in frames if f < b), default=0) + 1
        feats = np.zeros((1, s, enc.cfg.input_feat_size), np.float32)
        return (feats, np.ones((1, s), bool)), {}

    if isinstance(frames, int):

        def check(b: int) -> None:
            if b % frames:
                raise ValueError(
                    f"bucket {b} is not a multiple of Gemma3nAudioEncoder's frame granularity "
                    f"{frames}"
                )

        return BucketInputs((), check, make)
    frames = tuple(frames)
    return BucketInputs(frames, _one_of(type(enc).__name__, frames, "frame"), make)


def _voxtral(enc: Any) -> BucketInputs:
    cfg = enc.cfg

    def make(b: int) -> tuple[tuple, dict]:  # b windows, one audio each
        features = np.zeros((b, cfg.num_mel_bins, cfg.chunk_frames), np.float32)
        return (), {"input_features": features}

    if enc.chunk_buckets is not None:
        chunks = tuple(enc.chunk_buckets)
        return BucketInputs(chunks, _one_of(type(enc).__name__, chunks, "window"), make)

    def check(b: int) -> None:
        if b & (b - 1):
            raise ValueError(
                f"bucket {b} is not a power of two (VoxtralAudioEncoder without chunk_buckets "
                "pads window counts to powers of two)"
            )

    return BucketInputs(_VOXTRAL_DEFAULT, check, make)


def _chameleon(enc: Any) -> BucketInputs:
    from jaxsync.models.chameleon import IMAGE_BUCKETS

    images = tuple(IMAGE_BUCKETS if enc.buckets is None else enc.buckets)

    def make(b: int) -> tuple[tuple, dict]:  # b images
        return (np.zeros((b, *enc.image_shape), np.float32),), {}

    return BucketInputs(images, _one_of(type(enc).__name__, images, "image"), make)


# family sub-package -> (encoder class name, its BucketInputs builder)
_FAMILIES: dict[str, tuple[str, Callable[[Any], BucketInputs]]] = {
    "glm4v": ("Glm4vVisionEncoder", _glm4v),
    "qwen3_omni": ("Qwen3OmniAudioEncoder", _qwen3_omni),
    "gemma3n": ("Gemma3nAudioEncoder", _gemma3n),
    "voxtral": ("VoxtralAudioEncoder", _voxtral),
    "chameleon": ("ChameleonImageEncoder", _chameleon),
}


def bucket_inputs(encoder: Any) -> BucketInputs | None:
    """The `BucketInputs` of a family encoder, None for any other object.

    Only the family of the encoder's own class is imported.
    """
    import importlib

    module = type(encoder).__module__
    for family, (name, build) in _FAMILIES.items():
        if module.startswith(f"jaxsync.models.{family}") and type(encoder).__name__ == name:
            cls = getattr(importlib.import_module(f"jaxsync.models.{family}"), name)
            if isinstance(encoder, cls):
                return build(encoder)
    return None
