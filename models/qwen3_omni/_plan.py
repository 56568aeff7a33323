"""Host-side chunk planner: per-audio mel lengths -> every index the device needs, in numpy.

The chunking, attention windows and output gather follow from the lengths, which are host
metadata: the whole plan is computed on the host and its `meta` goes up in one packed transfer
(`jaxsync.upload_packed(plan)`), so the device never derives (or reads back) a length.

Device layout ("window layout"): `S = W * chunks_per_window` chunk slots of `2 * n_window`
frames, W the window bucket. Audio `a` owns `ceil(chunks_a / chunks_per_window)` consecutive
windows and fills their slots with its chunks in order; the rest of its last window stays empty.
After the convolutions a slot holds 13 token positions, so a window is `window_tokens` positions,
its valid tokens are a prefix (only an audio's last chunk is short), and upstream's attention
windows (`cu_seqlens`) are exactly these windows. An audio's tokens are contiguous in the
flattened layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

import jaxsync
from jaxsync._host import host_int, host_ints
from jaxsync.models.qwen3_omni._config import Qwen3OmniAudioConfig, conv_out_len
from jaxsync.models.qwen3_omni._features import (
    FRAME_BUCKETS,
    ITEM_BUCKETS,
    WINDOW_BUCKETS,
    check_feature_lens,
)


class Qwen3OmniBuckets(NamedTuple):
    """The sizes programs are compiled for; a plan pads each of its sizes to the smallest fit.

    Attributes:
      frames: padded mel-frame counts of a feature batch (default `FRAME_BUCKETS`).
      windows: attention-window counts W (default `WINDOW_BUCKETS`).
      items: audio counts I of the per-item finite flags (default `ITEM_BUCKETS`).
    """

    frames: Sequence[int] = FRAME_BUCKETS
    windows: Sequence[int] = WINDOW_BUCKETS
    items: Sequence[int] = ITEM_BUCKETS


class Qwen3OmniMeta(NamedTuple):
    """The int32 arrays the forward reads (`meta.<field>`), uploaded in one transfer.

    S = W * chunks_per_window chunk slots, W the window bucket, Q = window_tokens, I the item
    bucket, T the padded frame count.

    Attributes:
      slot_starts: [S] first frame of each slot's chunk in the features (0 if empty).
      slot_lens: [S] frames of each slot's chunk (0 if empty).
      conv_limits: [2] lengths of the first two conv outputs of the batch's longest chunk;
        upstream pads the conv batch to its longest chunk, so positions past these are zero.
      window_lens: [W] valid tokens of each window (0 for padding windows).
      window_items: [W] the audio each window belongs to; I for padding windows.
      out_src: [W * Q] flat window-layout position of each output row; padding rows hold the
        out-of-range sentinel W * Q (gathered as zeros).
      item_rows: [I] output rows of each audio (0 past the audios).
      frames: [T, 0]: no data, its static shape is the frame count the features must have.
    """

    slot_starts: np.ndarray
    slot_lens: np.ndarray
    conv_limits: np.ndarray
    window_lens: np.ndarray
    window_items: np.ndarray
    out_src: np.ndarray
    item_rows: np.ndarray
    frames: np.ndarray


class Qwen3OmniPlan(NamedTuple):
    """One batch of audios planned on the host.

    Attributes:
      meta: what the device reads (`jaxsync.upload_packed(plan)`).
      lengths: output rows per audio (upstream `_get_feat_extract_output_lengths`), as ints.
      num_frames: frames the features must have (T, static).
      num_windows: real attention windows; `window_bucket`: W, the windows compiled for.
      num_items: audios; `item_bucket`: I, the length of the per-item finite flags.
      feature_lens: [A] mel frames per audio.
      chunk_counts: [A] chunks per audio, `ceil(L / chunk_len)`.
      chunk_lens, chunk_starts, chunk_tokens, chunk_slots: [C] per real chunk (audio-major):
        frames, first frame in the features, tokens after the convolutions, slot.
      window_counts: [A] attention windows per audio.
      token_windows: [sum(lengths)] window of each output token (upstream `cu_seqlens`).
      slot_tokens: [S] tokens of each slot's chunk (0 if empty).
    """

    meta: Qwen3OmniMeta
    lengths: tuple[int, ...]
    num_frames: int
    num_windows: int
    window_bucket: int
    num_items: int
    item_bucket: int
    feature_lens: np.ndarray
    chunk_counts: np.ndarray
    chunk_lens: np.ndarray
    chunk_starts: np.ndarray
    chunk_tokens: np.ndarray
    chunk_slots: np.ndarray
    window_counts: np.ndarray
    token_windows: np.ndarray
    slot_tokens: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Real output rows (sum over audios)."""
        return sum(self.lengths)


def entry_buckets(
    buckets: Qwen3OmniBuckets | None, window_buckets: Sequence[int] | None
) -> Qwen3OmniBuckets:
    """An entry's bucket options, checked when it is built rather than at its first call:
    `buckets` (default `Qwen3OmniBuckets()`) with `window_buckets` in place of its windows."""
    if buckets is None:
        buckets = Qwen3OmniBuckets()
    elif not isinstance(buckets, Qwen3OmniBuckets):
        raise TypeError(f"buckets must be a Qwen3OmniBuckets, got {type(buckets).__name__}")
    if window_buckets is not None:
        sizes = host_ints(window_buckets, name="window_buckets", minimum=1)
        if not sizes.size or (np.diff(sizes) <= 0).any():
            raise ValueError(f"window_buckets must be ascending and non-empty, got {sizes}")
        buckets = buckets._replace(windows=tuple(sizes.tolist()))
    for sizes in buckets:
        jaxsync.bucket(0, sizes)
    return buckets


def plan(
    feature_lens: Sequence[int] | np.ndarray,
    cfg: Qwen3OmniAudioConfig,
    *,
    buckets: Qwen3OmniBuckets | None = None,
    num_frames: int | None = None,
) -> Qwen3OmniPlan:
    """Plans the chunking, attention windows and output gather of one batch of audios.

    Every static size comes from `buckets`: the window count W, the item count I (so 2 and 3
    audios share one program) and, by default, the frame count T.

    Args:
      feature_lens: [A] host mel-frame counts (0 allowed: that audio yields no rows).
      cfg: the encoder config.
      buckets: the sizes to pad to (default `Qwen3OmniBuckets()`, which fits the released
        processor's 128-bin, 100-frames-per-second features up to hours of audio).
      num_frames: the frame count T of features the caller already holds: `sum(feature_lens)`
        (unpadded) or the frame bucket of it. None: the frame bucket (pad the features to it,
        e.g. with `pad_features`).

    Raises:
      TypeError / ValueError: invalid lengths or buckets, a frame count that is neither the
        total nor its bucket, or a size beyond the largest bucket.
    """
    if buckets is None:
        buckets = Qwen3OmniBuckets()
    elif not isinstance(buckets, Qwen3OmniBuckets):
        raise TypeError(f"buckets must be a Qwen3OmniBuckets or None, got {type(buckets).__name__}")
    lens = check_feature_lens(feature_lens)
    total = int(lens.sum())
    padded = jaxsync.bucket(total, buckets.frames)
    num_frames = padded if num_frames is None else host_int(num_frames, name="num_frames")
    if num_frames not in (total, padded):
        raise ValueError(
            f"feature_lens sum to {total} frames but the features have {num_frames}; expected "
            f"{total} (unpadded) or {padded} (padded to the frame bucket)"
        )
    per_win, win_tok, chunk = cfg.chunks_per_window, cfg.window_tokens, cfg.chunk_len
    num_audio = lens.size

    counts = (lens + chunk - 1) // chunk  # [A]
    first_chunk = np.cumsum(counts) - counts
    audio_of_chunk = np.repeat(np.arange(num_audio), counts)  # [C]
    k = np.arange(int(counts.sum())) - first_chunk[audio_of_chunk]  # chunk index within its audio
    chunk_lens = np.minimum(chunk, lens[audio_of_chunk] - chunk * k)
    chunk_starts = (np.cumsum(lens) - lens)[audio_of_chunk] + chunk * k
    chunk_tokens = conv_out_len(conv_out_len(conv_out_len(chunk_lens)))

    windows = (counts + per_win - 1) // per_win  # [A]
    first_window = np.cumsum(windows) - windows
    num_windows = int(windows.sum())
    # At least one window slot, so an all-empty batch still has a valid (zero) program.
    w_pad = jaxsync.bucket(max(num_windows, 1), buckets.windows)
    i_pad = jaxsync.bucket(num_audio, buckets.items)
    slots = first_window[audio_of_chunk] * per_win + k
    slot_starts, slot_lens, slot_tokens = (np.zeros(w_pad * per_win, np.int64) for _ in range(3))
    slot_starts[slots], slot_lens[slots], slot_tokens[slots] = (
        chunk_starts,
        chunk_lens,
        chunk_tokens,
    )

    tokens = np.zeros(num_audio, np.int64)
    np.add.at(tokens, audio_of_chunk, chunk_tokens)
    offsets = np.cumsum(tokens) - tokens
    audio_of_token = np.repeat(np.arange(num_audio), tokens)  # [sum(tokens)]
    t = np.arange(int(tokens.sum())) - offsets[audio_of_token]  # token index within its audio
    out_src = np.full(w_pad * win_tok, w_pad * win_tok, np.int64)
    out_src[: t.size] = first_window[audio_of_token] * win_tok + t
    token_windows = first_window[audio_of_token] + t // win_tok
    window_items = np.full(w_pad, i_pad, np.int64)
    window_items[:num_windows] = np.repeat(np.arange(num_audio), windows)
    item_rows = np.zeros(i_pad, np.int64)
    item_rows[:num_audio] = tokens

    longest = int(chunk_lens.max()) if chunk_lens.size else 0
    meta = Qwen3OmniMeta(
        slot_starts=slot_starts.astype(np.int32),
        slot_lens=slot_lens.astype(np.int32),
        conv_limits=np.array(
            [conv_out_len(longest), conv_out_len(conv_out_len(longest))], np.int32
        ),
        window_lens=np.bincount(token_windows, minlength=w_pad).astype(np.int32),
        window_items=window_items.astype(np.int32),
        out_src=out_src.astype(np.int32),
        item_rows=item_rows.astype(np.int32),
        frames=np.zeros((num_frames, 0), np.int32),
    )
    return Qwen3OmniPlan(
        meta=meta,
        lengths=tuple(tokens.tolist()),
        num_frames=num_frames,
        num_windows=num_windows,
        window_bucket=w_pad,
        num_items=num_audio,
        item_bucket=i_pad,
        feature_lens=lens,
        chunk_counts=counts,
        chunk_lens=chunk_lens,
        chunk_starts=chunk_starts,
        chunk_tokens=chunk_tokens,
        chunk_slots=slots,
        window_counts=windows,
        token_windows=token_windows,
        slot_tokens=slot_tokens,
    )


def plan_features(
    features_shape: Sequence[int],
    feature_lens: Sequence[int] | np.ndarray,
    cfg: Qwen3OmniAudioConfig,
    buckets: Qwen3OmniBuckets,
) -> Qwen3OmniPlan:
    """`plan` of features of `features_shape` [num_mel_bins, T], the shape checked first.

    Raises:
      ValueError / TypeError: wrong rank or mel-bin count, and as `plan`.
    """
    if len(features_shape) != 2:
        raise ValueError(f"features must be [num_mel_bins, frames], got shape {features_shape}")
    if features_shape[0] != cfg.num_mel_bins:
        raise ValueError(
            f"features have {features_shape[0]} mel bins, the encoder expects "
            f"{cfg.num_mel_bins} (shape must be [num_mel_bins, frames])"
        )
    return plan(feature_lens, cfg, buckets=buckets, num_frames=features_shape[1])


def lengths_planner(feature_lens: Any, cfg: Qwen3OmniAudioConfig, buckets: Qwen3OmniBuckets):
    """`planner(features, where)` of `TowerEntry.run`: `plan_features` cached per (shape, dtype,
    placement, lengths). A list or tuple of ints (what a server passes) is the key without
    numpy; other lengths pass the type checks first (`type(n) is int` keeps floats and bools,
    equal to ints with the same hash, off the fast key)."""

    def planner(features: Any, where: Any):
        if type(feature_lens) in (list, tuple) and all(type(n) is int for n in feature_lens):
            lens = tuple(feature_lens)
        else:
            lens = tuple(check_feature_lens(feature_lens).tolist())  # the same key
        key = (features.shape, features.dtype, getattr(features, "sharding", None), lens)
        return key, lambda: plan_features(features.shape, lens, cfg, buckets)

    return planner
