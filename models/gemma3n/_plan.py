"""Host planning of the Gemma 3n audio path: validation, buckets, the fixed-length layout.

Every clip becomes exactly `soft_tokens` embedding rows (the prompt holds that many audio
placeholders per clip): tower positions first, then the padding token's embedding, cached on the
device by the entry. The plan says which frames are real and how the rows are laid out; it is
numpy only, and its `fields` go up in one `jaxsync.upload_packed`.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import jaxsync
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig


__all__ = [
    "AudioTruncationWarning",
    "Gemma3nAudioPlan",
    "frame_mask",
    "check_host_finite",
    "host_clips",
    "host_features",
    "plan_audio",
    "stage_features",
]

FEATURES = "input_features"
MASK = "input_features_mask"


class AudioTruncationWarning(UserWarning):
    """A clip produced more tower positions than `soft_tokens`; the excess was dropped."""


@dataclasses.dataclass(frozen=True, eq=False)
class Gemma3nAudioPlan:
    """One call's layout: `num_clips` clips of `frames` frames padded to `[batch, frame_bucket]`.

    Attributes:
        fields: `valid` `[batch, frame_bucket]` bool (True = real frame) and `frames` `[1]`
            int32, for `jaxsync.upload_packed`.
        num_clips: clips in the call (rows past them are padding clips).
        frames: frames per clip as given (upstream's sequence length, before bucketing).
        soft_tokens: embedding rows per clip.
        truncation: the warning to emit on every call with this plan (overflow="truncate" and
            a clip lost real positions), or None.
    """

    fields: dict[str, np.ndarray]
    num_clips: int
    frames: int
    soft_tokens: int
    truncation: str | None = None

    @property
    def batch(self) -> int:
        return self.fields["valid"].shape[0]

    @property
    def frame_bucket(self) -> int:
        return self.fields["valid"].shape[1]

    @property
    def lengths(self) -> tuple[int, ...]:
        return (self.soft_tokens,) * self.num_clips

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(range(0, self.num_clips * self.soft_tokens, self.soft_tokens))


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
    m = jaxsync.host_array(mask, name=MASK)
    if m.dtype != np.bool_:
        if not np.issubdtype(m.dtype, np.integer) and m.size:
            raise TypeError(f"{MASK} must hold bools or 0/1 integers, got dtype {m.dtype}")
        if m.size and not np.isin(m, (0, 1)).all():
            raise ValueError(f"{MASK} must hold 0/1 (or bools), got values {np.unique(m)[:5]}")
    if m.shape != tuple(shape):
        raise ValueError(f"{MASK} shape {m.shape} != {FEATURES} shape[:2] {tuple(shape)}")
    return m.astype(bool, copy=False)


def _clip(f: Any, i: int, n_mel: int) -> np.ndarray:
    c = jaxsync.host_array(f, name=f"{FEATURES}[{i}]")
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
            True
            if m is None
            else frame_mask(jaxsync.host_array(m, name=MASK)[None], (1, len(c)))[0]
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
        feats = jaxsync.host_array(features, name=FEATURES)
        if feats.ndim != 3:
            raise ValueError(f"{FEATURES} must be [B, frames, mel] (or a list), got {feats.shape}")
        if feats.shape[2] != n_mel:
            raise ValueError(f"{FEATURES} have {feats.shape[2]} mel bins; the config has {n_mel}")
        _float_dtype(feats)
        valid = frame_mask(mask, feats.shape[:2])
        feats = feats.astype(np.float32, copy=False)
    if check_finite:
        jaxsync.check_finite(feats, name=FEATURES)
    return feats, valid


def _float_dtype(x: np.ndarray) -> None:
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{FEATURES} must be floating point log-mel features, got {x.dtype}")


def _truncation(cfg: Gemma3nAudioConfig, valid: np.ndarray, t_a: int) -> str | None:
    """Overflow policy for a tower longer than `soft_tokens`: raise, or the warning to emit."""
    msg = (
        f"audio gives {t_a} tower positions for {valid.shape[1]} frames, more than "
        f"soft_tokens={cfg.soft_tokens}"
    )
    if cfg.overflow == "error":
        raise ValueError(
            msg + " (overflow='error', as transformers; use 'truncate' to keep the first "
            "soft_tokens as vLLM does)"
        )
    # Real positions per clip, from the host mask exactly as the tower subsamples it.
    t_sub = cfg.num_subsampled(valid.shape[1])
    idx = np.minimum(np.arange(t_sub) * cfg.time_stride, valid.shape[1] - 1)
    dropped = valid[:, idx][:, :: cfg.conf_reduction_factor][:, cfg.soft_tokens :].sum(axis=1)
    lost = {i: int(r) for i, r in enumerate(dropped) if r}
    return (
        f"{msg}; truncated to the first {cfg.soft_tokens} (vLLM behaviour); "
        f"real positions dropped per clip: {lost}"
    )


def _frame_bucket(s: int, frame_buckets: int | Sequence[int]) -> int:
    if isinstance(frame_buckets, int):
        return -(-s // frame_buckets) * frame_buckets
    return jaxsync.bucket(s, frame_buckets)


def plan_audio(
    valid: Any,
    cfg: Gemma3nAudioConfig,
    *,
    frame_buckets: int | Sequence[int] = 512,
    batch_buckets: Sequence[int] | None = None,
) -> Gemma3nAudioPlan:
    """Plans one call from the host frame mask `[B, S]` (bool, True = real frame).

    Frames are padded to `frame_buckets` (an int G: a multiple of G; a sequence: the smallest
    that fits), clips to `batch_buckets` (default powers of two).

    Raises:
        TypeError: a mask of floats (or other non-integers).
        ValueError: a mask that is not `[B, S]` of 0/1, a clip without a real frame, no frame
            at all, or (overflow="error") more tower positions than `soft_tokens`.
    """
    valid = frame_mask(valid, np.shape(valid))  # bools or 0/1 ints, from any caller
    if valid.ndim != 2:
        raise ValueError(f"the frame mask must be [B, S], got shape {valid.shape}")
    b, s = valid.shape
    if b == 0 or s == 0 or not valid.any(axis=1).all():
        empty = [i for i in range(b) if s == 0 or not valid[i].any()]
        raise ValueError(f"audio clip(s) {empty or 'all'} have no valid frame (all padding)")
    t_a = cfg.num_tower_positions(s)
    truncation = _truncation(cfg, valid, t_a) if t_a > cfg.soft_tokens else None
    b_pad = jaxsync.bucket(b, batch_buckets, minimum=1)
    s_pad = _frame_bucket(s, frame_buckets)
    v_up = np.zeros((b_pad, s_pad), bool)
    v_up[:b, :s] = valid
    fields = {"valid": v_up, "frames": np.array([s], np.int32)}
    return Gemma3nAudioPlan(
        fields=fields, num_clips=b, frames=s, soft_tokens=cfg.soft_tokens, truncation=truncation
    )


def check_host_finite(host: np.ndarray | list[np.ndarray]) -> None:
    """NaN / inf in host features (a `[B, S, F]` array, or each clip of a list) refused."""
    if isinstance(host, np.ndarray):
        jaxsync.check_finite(host, name=FEATURES)
        return
    for i, clip in enumerate(host):
        jaxsync.check_finite(clip, name=f"{FEATURES}[{i}]")


def stage_features(
    host: np.ndarray | list[np.ndarray], shape: tuple[int, int, int], placement: Any
):
    """Host features zero padded into `shape` `[B_pad, S_pad, F]` float32 and uploaded, NaN /
    inf refused as they are copied (one pass)."""
    ring = jaxsync.default_staging
    if isinstance(host, np.ndarray):
        return ring.put(host, shape, dtype=np.float32, placement=placement, finite=FEATURES)

    def write(out: np.ndarray) -> None:
        bad = jaxsync.fill_rows(out, host, [len(c) for c in host], check_finite=True)
        if bad:
            raise ValueError(f"{FEATURES}[{bad[0]}] holds a non-finite value")

    return ring.stage(shape, np.float32, write, placement=placement)
