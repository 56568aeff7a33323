"""Host planning of the Gemma 3n audio path: buckets, the frame mask, the fixed-length layout.

Every clip becomes exactly `soft_tokens` embedding rows (the prompt holds that many audio
placeholders per clip): tower positions first, then the padding token's embedding. With the
embedder left out, a clip owns the tower's positions for the call's frame count instead. The
plan is numpy only; its `meta` goes up in one `jaxsync.upload_packed(plan)` and the forward reads
it as `meta.valid`, `meta.frames`, `meta.positions`.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

import jaxsync
from jaxsync._host import host_int, host_ints
from jaxsync._plans import content_key
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._inputs import frame_mask


__all__ = [
    "CLIP_BUCKETS",
    "FRAME_BUCKETS",
    "AudioTruncationWarning",
    "Gemma3nBuckets",
    "Gemma3nMeta",
    "Gemma3nPlan",
    "plan",
]

# The released feature extractor gives at most 2,997 frames (30 s, 10 ms hop) and pads a batch
# to its longest clip; 3,008 is the most frames whose tower stays within the released 188 soft
# tokens, so a bucketed 30 s batch computes no position that is dropped afterwards.
FRAME_BUCKETS = (128, 256, 512, 1024, 2048, 3008)
# One clip alone, then from 4 up: 2, 3 and 4 clips share one program.
CLIP_BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256)


class AudioTruncationWarning(UserWarning):
    """A clip produced more tower positions than `soft_tokens`; the excess was dropped."""


class Gemma3nBuckets(NamedTuple):
    """The static pads a plan picks from.

    Attributes:
        frames: frame buckets: increasing sizes (the smallest that holds the clips' frames), or
            an int G (frames rounded up to a multiple of G).
        clips: increasing clip-count buckets (by default 2, 3 and 4 clips share one program).
    """

    frames: int | Sequence[int] = FRAME_BUCKETS
    clips: Sequence[int] = CLIP_BUCKETS


class Gemma3nMeta(NamedTuple):
    """The plan's device metadata (host numpy arrays, uploaded in one `upload_packed`).

    Attributes:
        valid: `[B_pad, S_pad]` bool, True at a clip's real frames (padding clips: all False).
        frames: `[1]` int32, frames per clip before bucketing (the length upstream sees).
        positions: `[1]` int32, tower positions per clip at that frame count.
    """

    valid: np.ndarray
    frames: np.ndarray
    positions: np.ndarray


class Gemma3nPlan(NamedTuple):
    """One call's layout: `num_clips` clips of `frames` frames padded to `[batch, frame_bucket]`.

    Attributes:
        meta: what the forward reads on the device (`Gemma3nMeta`).
        lengths: rows per clip (`soft_tokens` each; the tower's positions without the embedder).
        num_clips: clips in the call (clips past them are padding).
        frames: frames per clip as given.
        batch: clips after padding (a clip bucket).
        frame_bucket: frames after padding (a frame bucket).
        truncation: what every call with this plan warns (overflow="truncate" and a clip lost
            real positions), or None; `warning` is it as an `AudioTruncationWarning`.
    """

    meta: Gemma3nMeta
    lengths: tuple[int, ...]
    num_clips: int
    frames: int
    batch: int
    frame_bucket: int
    truncation: str | None = None

    @property
    def offsets(self) -> tuple[int, ...]:
        """First row of each clip: the running sum of `lengths`, from row 0."""
        return tuple(int(o) for o in np.cumsum((0, *self.lengths[:-1])))

    @property
    def warning(self) -> AudioTruncationWarning | None:
        """The entry's warning on every call with this plan, at the caller's line."""
        return None if self.truncation is None else AudioTruncationWarning(self.truncation)


def _truncation(cfg: Gemma3nAudioConfig, valid: np.ndarray, t_a: int) -> str:
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


def _frame_bucket(s: int, frames: int | Sequence[int]) -> int:
    if isinstance(frames, int | np.integer) and not isinstance(frames, bool | np.bool_):
        g = host_int(frames, name="frame buckets", minimum=1)
        return -(-s // g) * g
    return jaxsync.bucket(s, frames)


def plan(
    valid: Any,
    cfg: Gemma3nAudioConfig,
    *,
    buckets: Gemma3nBuckets | None = None,
    embed: bool = True,
) -> Gemma3nPlan:
    """Plans one call from the host frame mask `[B, S]` (bools or 0/1 ints, True = real frame).

    Args:
        valid: the processor's `input_features_mask` (host data).
        cfg: the model's config (`model.cfg`).
        buckets: the frame and clip buckets; default `Gemma3nBuckets()`, which holds the
            released processor's batches (up to 3,008 frames, 256 clips).
        embed: True: `soft_tokens` rows per clip (the embedder's output); False: the tower's
            positions per clip (no `soft_tokens` overflow policy applies).

    Raises:
        TypeError: a mask of floats (or other non-integers).
        ValueError: a mask that is not `[B, S]` of 0/1, a clip without a real frame, more
            frames or clips than the largest bucket, or (overflow="error", with `embed`) more
            tower positions than `soft_tokens`.
    """
    buckets = Gemma3nBuckets() if buckets is None else buckets
    valid = frame_mask(valid, np.shape(valid))  # bools or 0/1 ints, from any caller
    if valid.ndim != 2:
        raise ValueError(f"the frame mask must be [B, S], got shape {valid.shape}")
    b, s = valid.shape
    if b == 0 or s == 0 or not valid.any(axis=1).all():
        empty = [i for i in range(b) if s == 0 or not valid[i].any()]
        raise ValueError(f"audio clip(s) {empty or 'all'} have no valid frame (all padding)")
    t_a = cfg.num_tower_positions(s)
    truncation = None
    if embed and t_a > cfg.soft_tokens:
        truncation = _truncation(cfg, valid, t_a)
    b_pad = jaxsync.bucket(b, buckets.clips)
    s_pad = _frame_bucket(s, buckets.frames)
    v_up = np.zeros((b_pad, s_pad), bool)
    v_up[:b, :s] = valid
    meta = Gemma3nMeta(v_up, np.array([s], np.int32), np.array([t_a], np.int32))
    rows = cfg.soft_tokens if embed else t_a
    return Gemma3nPlan(meta, (rows,) * b, b, s, b_pad, s_pad, truncation)


def entry_buckets(frames: Any, clips: Any) -> Gemma3nBuckets:
    """An entry's bucket options, checked (ints >= 1); None takes the planner's default."""
    default = Gemma3nBuckets()
    if frames is None:
        frames = default.frames
    elif isinstance(frames, Sequence | np.ndarray):
        frames = tuple(host_ints(frames, name="frame_buckets", minimum=1).tolist())
    else:
        frames = host_int(frames, name="frame_buckets", minimum=1)
    if clips is None:
        return Gemma3nBuckets(frames, default.clips)
    return Gemma3nBuckets(frames, tuple(host_ints(clips, name="batch_buckets", minimum=1).tolist()))


def mask_planner(mask: Any, cfg: Gemma3nAudioConfig, *, embed: bool = True):
    """`planner(features, where)` of device features `[B, S, F]`, planned at their own shape
    (the caller's buffer is the bucket): the plan cached per content of the host `mask`, which
    is checked on a miss."""

    def planner(features: Any, where: Any):
        shape = tuple(features.shape[:2])
        key, checked = content_key(mask, lambda m: frame_mask(m, shape))
        exact = Gemma3nBuckets(frames=(shape[1],), clips=(shape[0],))

        def build() -> Gemma3nPlan:
            return plan(frame_mask(checked, shape), cfg, buckets=exact, embed=embed)

        return (key, shape, where, exact), build

    return planner


def host_planner(valid: np.ndarray, cfg: Gemma3nAudioConfig, *, buckets: Any, embed: bool = True):
    """`planner(features, where)` of host features with the checked frame mask `valid` `[B, S]`,
    padded into the entry's `buckets`: the plan cached per content of the mask."""

    def planner(features: Any, where: Any):
        key = ((valid.shape, valid.tobytes()), where, buckets)
        return key, lambda: plan(valid, cfg, buckets=buckets, embed=embed)

    return planner
