"""Host inputs of the Gemma 3n audio path: processor features and masks, validated and staged.

transformers' `Gemma3nAudioFeatureExtractor` gives `[B, S, F]` features with an
`input_features_mask` `[B, S]` (True = real frame); vLLM passes a list of `[S_i, F]` clips. Both
are validated here on the host (numpy only), before anything is planned or uploaded.
"""

from typing import Any

import jax
import numpy as np

import jaxsync
from jaxsync import _host
from jaxsync._calls import reads
from jaxsync._fill import fill_rows
from jaxsync._host import check_finite, host_array


__all__ = [
    "FEATURES",
    "MASK",
    "check_host_finite",
    "frame_mask",
    "host_clips",
    "host_features",
    "stage_features",
]

FEATURES = "input_features"
MASK = "input_features_mask"


def frame_mask(mask: Any, shape: tuple[int, int]) -> np.ndarray:
    """The processor's `input_features_mask` `[B, S]` (True = real frame) as bool.

    Raises:
        TypeError: floats or other non-integer dtypes.
        ValueError: wrong shape, or integers other than 0 and 1.
    """
    if mask is None:
        raise ValueError(f"{MASK} is required with a batched {FEATURES} array")
    if isinstance(mask, jax.Array):
        raise TypeError(
            f"{MASK} must be host data (numpy, list, torch CPU tensor): it is host "
            "metadata the plan reads; got a jax array"
        )
    m = host_array(mask, name=MASK)
    if m.dtype != np.bool_:
        if not np.issubdtype(m.dtype, np.integer) and m.size:
            raise TypeError(f"{MASK} must hold bools or 0/1 integers, got dtype {m.dtype}")
        if m.size and not np.isin(m, (0, 1)).all():
            raise ValueError(f"{MASK} must hold 0/1 (or bools), got values {np.unique(m)[:5]}")
    if m.shape != tuple(shape):
        raise ValueError(f"{MASK} shape {m.shape} != {FEATURES} shape[:2] {tuple(shape)}")
    return m.astype(bool, copy=False)


def _clip(f: Any, i: int, n_mel: int) -> np.ndarray:
    c = host_array(f, name=f"{FEATURES}[{i}]")
    if c.ndim != 2 or c.shape[1] != n_mel:
        raise ValueError(f"clip {i}: {FEATURES} must be [frames, {n_mel}], got {c.shape}")
    return c


def host_clips(features: Any, mask: Any, n_mel: int) -> tuple[list[np.ndarray], np.ndarray]:
    """A list of `[S_i, F]` host clips (vLLM's form), validated and kept as given (the encoder
    copies them straight into their bucket), and the `[B, S]` bool mask of their real frames
    (mask None = all real, or a list of `[S_i]`). Their values are not checked here.
    """
    clips = [_clip(f, i, n_mel) for i, f in enumerate(features)]
    if not clips:
        raise ValueError(f"{FEATURES} holds no audio clip")
    masks = [None] * len(clips) if mask is None else list(mask)
    if len(masks) != len(clips):
        raise ValueError(f"{len(clips)} feature clips but {len(masks)} masks")
    valid = np.zeros((len(clips), max(len(c) for c in clips)), bool)
    for i, (c, m) in enumerate(zip(clips, masks, strict=True)):
        _float_dtype(c)
        valid[i, : len(c)] = (
            True if m is None else frame_mask(host_array(m, name=MASK)[None], (1, len(c)))[0]
        )
    return clips, valid


def host_features(
    features: Any, mask: Any, n_mel: int, *, check_finite: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Host features in either upstream form -> `[B, S, F]` float32 and `[B, S]` bool (valid).

    `features` is `[B, S, F]` with its mask (transformers' processor output; numpy or torch CPU),
    or a list of `[S_i, F]` clips (vLLM's form; mask None = all valid, or a list of `[S_i]`),
    zero padded to the longest.

    `check_finite=False` leaves the NaN / inf check to the caller (the encoder checks while it
    copies the features into their staging buffer).

    Raises:
        TypeError: non-float features, non-integer masks.
        ValueError: wrong rank, mel-bin or mask shape, no clip, or a NaN / inf anywhere.
    """
    if isinstance(features, list | tuple):
        clips, valid = host_clips(features, mask, n_mel)
        feats = np.zeros((len(clips), valid.shape[1], n_mel), np.float32)
        for i, c in enumerate(clips):
            feats[i, : len(c)] = c
    else:
        feats = host_array(features, name=FEATURES)
        if feats.ndim != 3:
            raise ValueError(f"{FEATURES} must be [B, frames, mel] (or a list), got {feats.shape}")
        if feats.shape[2] != n_mel:
            raise ValueError(f"{FEATURES} have {feats.shape[2]} mel bins; the config has {n_mel}")
        _float_dtype(feats)
        valid = frame_mask(mask, feats.shape[:2])
        feats = feats.astype(np.float32, copy=False)
    if check_finite:  # the argument shadows the function
        _host.check_finite(feats, name=FEATURES)
    return feats, valid


def host_inputs(features: Any, mask: Any, n_mel: int) -> tuple[Any, np.ndarray]:
    """(features, frame mask) of host input: a list of clips (`host_clips`, copied straight
    into the bucket later) or a padded batch (`host_features`; finiteness checked later)."""
    if isinstance(features, list | tuple):
        return host_clips(features, mask, n_mel)
    return host_features(features, mask, n_mel, check_finite=False)


def device_check(n_mel: int):
    """The check of device features: `[B, frames, n_mel]`, floating point."""

    @reads("shape", "dtype")
    def check(feats: jax.Array) -> None:
        if feats.ndim != 3 or feats.shape[2] != n_mel:
            raise ValueError(f"{FEATURES} must be [B, frames, {n_mel}], got {feats.shape}")
        if not jax.numpy.issubdtype(feats.dtype, jax.numpy.floating):
            raise TypeError(f"{FEATURES} must be floating point, got {feats.dtype}")

    return check


def _float_dtype(x: np.ndarray) -> None:
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{FEATURES} must be floating point log-mel features, got {x.dtype}")


def check_host_finite(host: np.ndarray | list[np.ndarray]) -> None:
    """NaN / inf in host features (a `[B, S, F]` array, or each clip of a list) refused."""
    if isinstance(host, np.ndarray):
        check_finite(host, name=FEATURES)
        return
    for i, clip in enumerate(host):
        check_finite(clip, name=f"{FEATURES}[{i}]")


def stage_features(host: np.ndarray | list[np.ndarray], plan: Any, n_mel: int, placement: Any):
    """Host features zero padded into the plan's bucket `[batch, frame_bucket, n_mel]` float32
    and uploaded, NaN / inf refused as they are copied (one pass)."""
    ring = jaxsync.default_staging
    shape = (plan.batch, plan.frame_bucket, n_mel)
    if isinstance(host, np.ndarray):
        return ring.put(host, shape, dtype=np.float32, placement=placement, finite=FEATURES)

    def write(out: np.ndarray) -> None:
        bad = fill_rows(out, host, [len(c) for c in host], check_finite=True)
        if bad:
            raise ValueError(f"{FEATURES}[{bad[0]}] holds a non-finite value")

    return ring.stage(shape, np.float32, write, placement=placement)
