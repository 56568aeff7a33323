"""Host inputs of the Qwen3-Omni audio encoder: lengths, the processor's batch, frame padding,
and the shape buckets compiled programs are shared over."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync import _host
from jaxsync._calls import reads
from jaxsync._host import host_array, host_ints
from jaxsync.models.qwen3_omni._config import TOKENS_PER_FULL_CHUNK


def _geometric(minimum: int, steps: int = 4, limit: int = 1 << 26) -> tuple[int, ...]:
    """Every integer up to `minimum`, then `steps` sizes per octave (<= 25% padding)."""
    out, p = list(range(1, minimum + 1)), minimum
    while p < limit:
        out += [p + p * i // steps for i in range(1, steps + 1)]
        p *= 2
    return tuple(out)


WINDOW_BUCKETS = _geometric(8)
"""Attention-window counts the device program is compiled for."""
FRAME_BUCKETS = tuple(b for b in _geometric(128) if b >= 128)
"""Mel-frame counts a padded feature batch may have (see `frame_bucket`)."""
ITEM_BUCKETS = tuple(16 << k for k in range(20))
"""Audio counts the per-item finite flags are padded to: a request's few audios (0 to 16) share
one program, and the flags cost 16 booleans."""


def frame_bucket(total_frames: int) -> int:
    """The padded frame count for `total_frames` frames (pad features to it to share programs)."""
    return jaxsync.bucket(total_frames, FRAME_BUCKETS)


def feat_extract_output_lengths(feature_lens: Any, n_window: int = 50) -> np.ndarray:
    """Tokens per audio after the encoder (upstream `_get_feat_extract_output_lengths`), numpy."""
    lens = np.asarray(feature_lens, dtype=np.int64)
    chunk = 2 * n_window
    rem = lens % chunk
    tail = (((rem - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1  # floor division: f(0) == 0
    return (lens // chunk) * TOKENS_PER_FULL_CHUNK + tail


def check_feature_lens(feature_lens: Any) -> np.ndarray:
    """Validates host lengths: a 1-D sequence of non-negative integers; returns int64.

    Raises:
      TypeError: device data (reading it would be a device->host sync), floats or bools.
      ValueError: not 1-D, ragged, or a negative length.
    """
    if isinstance(feature_lens, list | tuple) and any(
        isinstance(n, bool | np.bool_) for n in feature_lens
    ):  # numpy reads a mixed list [True, 5] as the ints [1, 5]
        raise TypeError(f"feature_lens must hold integers, got {feature_lens!r}")
    return host_ints(feature_lens, name="feature_lens")


def features_from_processor(
    input_features: Any, feature_attention_mask: Any, *, check_finite: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """The processor's padded batch as the encoder's `(features, feature_lens)`, on the host.

    The Qwen3-Omni processor (`WhisperFeatureExtractor`) returns each audio's log-mel frames
    padded to the longest, with a mask of its real frames; upstream keeps the masked frames
    (`input_features.permute(0, 2, 1)[mask.bool()].permute(1, 0)`), as this does.

    Args:
      input_features: [B, F, T] float features (numpy or a torch CPU tensor).
      feature_attention_mask: [B, T] 0/1 (or bool) frame mask, same container kinds.

      check_finite: False leaves the NaN / inf check of the real frames to the caller (the
        encoder checks while it copies them into their staging buffer).

    Returns:
      features: [F, sum(lens)] float32, the audios' real frames concatenated in time.
      feature_lens: [B] int64 real frames per audio.

    Raises:
      TypeError: device data, a non-float feature dtype, or a mask that is not integer/bool.
      ValueError: wrong ranks, mismatched B or T, a mask value other than 0/1, non-finite
        features in a real frame.
    """
    feats = host_array(input_features, name="input_features", ndim=3)
    if not np.issubdtype(feats.dtype, np.floating):
        raise TypeError(f"input_features must be floating point, got dtype {feats.dtype}")
    mask = host_array(feature_attention_mask, name="feature_attention_mask", ndim=2)
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
        raise TypeError(f"feature_attention_mask must be integer or bool, got dtype {mask.dtype}")
    if mask.shape != (feats.shape[0], feats.shape[2]):
        raise ValueError(
            f"feature_attention_mask has shape {mask.shape}, expected (batch, frames) = "
            f"{(feats.shape[0], feats.shape[2])} from input_features {feats.shape}"
        )
    if mask.size and not np.isin(mask, (0, 1)).all():
        raise ValueError("feature_attention_mask must hold only 0 and 1")
    keep = mask.astype(bool)
    features = np.ascontiguousarray(feats.transpose(0, 2, 1)[keep].T, np.float32)  # [F, sum]
    if check_finite:  # the argument shadows the function
        _host.check_finite(features, name="input_features")
    return features, keep.sum(axis=1).astype(np.int64)


def call_inputs(features: Any, feature_lens: Any, input_features: Any, mask: Any) -> tuple:
    """(features, feature_lens, the features' name) of an entry call given either form: the
    two arguments, or the processor's `input_features` and `feature_attention_mask`.

    Raises:
      TypeError: both forms, or a form half given.
    """
    if input_features is None and mask is None:
        if features is None or feature_lens is None:
            raise TypeError("features and feature_lens are required")
        return features, feature_lens, "features"
    if features is not None or feature_lens is not None:
        raise TypeError(
            "pass features + feature_lens or input_features + feature_attention_mask, not both"
        )
    if input_features is None or mask is None:
        raise TypeError("input_features and feature_attention_mask go together")
    return (*features_from_processor(input_features, mask, check_finite=False), "input_features")


def pad_features(features: Any, feature_lens: Any) -> np.ndarray:
    """Host helper: zero-pads [F, sum(lens)] features to [F, frame_bucket(sum(lens))] float32."""
    feats = host_array(features, name="features", ndim=2)
    total = int(check_feature_lens(feature_lens).sum())
    if feats.shape[-1] != total:
        raise ValueError(f"features have {feats.shape[-1]} frames, feature_lens sum to {total}")
    out = np.zeros((feats.shape[0], frame_bucket(total)), np.float32)
    out[:, :total] = feats
    return out


@reads("dtype")
def check_dtype(features: Any) -> None:
    """Refuses features that are not floating point (TypeError)."""
    if not jnp.issubdtype(features.dtype, jnp.floating):  # bfloat16 included
        raise TypeError(f"features must be floating point, got dtype {features.dtype}")
