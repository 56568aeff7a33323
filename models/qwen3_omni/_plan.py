"""Host-side chunk planner: per-audio mel lengths -> every index the device needs, in numpy.

Upstream (vLLM post-#51458 and HF) derives the chunking on the device and reads it back
(`chunk_num.sum()`, `chunk_lengths.tolist()`, `max(...).item()`, `aftercnn_lens.tolist()`). The
lengths are host metadata to begin with, so here the whole plan is computed on the host and goes up
in one packed transfer.

Device layout ("window layout"): `S = num_window_slots * chunks_per_window` chunk slots of
`2 * n_window` frames. Audio `a` owns `ceil(chunks_a / chunks_per_window)` consecutive windows and
fills their slots with its chunks in order; the rest of its last window stays empty. After the
convolutions a slot holds 13 token positions, so a window is `window_tokens` positions, its valid
tokens are a prefix (only an audio's last chunk is short), and upstream's attention windows
(`cu_seqlens`) are exactly these windows. An audio's tokens are contiguous in the flattened layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

import jaxsync
from jaxsync.models.qwen3_omni._config import TOKENS_PER_FULL_CHUNK, Qwen3OmniAudioConfig


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


def _conv1(n: np.ndarray) -> np.ndarray:
    return (n - 1) // 2 + 1


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
    return jaxsync.host_ints(feature_lens, name="feature_lens")


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
    feats = jaxsync.host_array(input_features, name="input_features", ndim=3)
    if not np.issubdtype(feats.dtype, np.floating):
        raise TypeError(f"input_features must be floating point, got dtype {feats.dtype}")
    mask = jaxsync.host_array(feature_attention_mask, name="feature_attention_mask", ndim=2)
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
    if check_finite:
        jaxsync.check_finite(features, name="input_features")
    return features, keep.sum(axis=1).astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkPlan:
    """Everything about one batch that follows from the lengths (all host numpy).

    Attributes:
      feature_lens: [A] mel frames per audio.
      chunk_counts: [A] chunks per audio, `ceil(L / chunk_len)`.
      chunk_lens: [C] frames of each real chunk (audio-major; full chunks, then the tail).
      chunk_starts: [C] first frame of each chunk in the concatenated features.
      chunk_tokens: [C] tokens of each chunk after the three stride-2 convolutions.
      chunk_slots: [C] slot of each chunk in the window layout.
      audio_tokens: [A] output tokens per audio (= `feat_extract_output_lengths`).
      audio_offsets: [A] first output row of each audio.
      window_counts: [A] attention windows per audio.
      window_lens: [W] valid tokens of each window slot (0 for padding windows).
      window_ranks: [W] rank of each window's audio among the non-empty audios (segment ids
        of the per-audio finite flags); `W` for padding windows.
      token_windows: [T] window of each output token (segment ids; upstream `cu_seqlens`).
      slot_starts, slot_lens, slot_tokens: [S] per-slot chunk start / frames / tokens (0 if empty).
      out_src: [W * window_tokens] flat window-layout position of each output row; padding rows
        hold the out-of-range sentinel `W * window_tokens` (gathered as zeros).
      conv_limits: [2] lengths of the first two conv outputs of the longest chunk; upstream pads
        the batch to its longest chunk, so conv positions past these are zero padding there.
      num_frames: frame count of the feature array (static shape).
      num_windows: real windows; `window_bucket`: windows the program is compiled for.
    """

    feature_lens: np.ndarray
    chunk_counts: np.ndarray
    chunk_lens: np.ndarray
    chunk_starts: np.ndarray
    chunk_tokens: np.ndarray
    chunk_slots: np.ndarray
    audio_tokens: np.ndarray
    audio_offsets: np.ndarray
    window_counts: np.ndarray
    window_lens: np.ndarray
    window_ranks: np.ndarray
    token_windows: np.ndarray
    slot_starts: np.ndarray
    slot_lens: np.ndarray
    slot_tokens: np.ndarray
    out_src: np.ndarray
    conv_limits: np.ndarray
    num_frames: int
    num_windows: int
    window_bucket: int

    @property
    def num_tokens(self) -> int:
        """Real output tokens (sum over audios)."""
        return int(self.audio_tokens.sum())

    @property
    def fields(self) -> dict[str, np.ndarray]:
        """The int32 arrays the device program reads (one `upload_packed` call).

        Empty audios leave no trace in them: a batch with and without them shares uploads.
        """
        names = (
            "slot_starts",
            "slot_lens",
            "slot_tokens",
            "window_lens",
            "window_ranks",
            "out_src",
            "conv_limits",
        )
        return {n: getattr(self, n).astype(np.int32) for n in names}


def plan_chunks(
    feature_lens: Sequence[int] | np.ndarray,
    cfg: Qwen3OmniAudioConfig,
    *,
    num_frames: int | None = None,
    window_buckets: Sequence[int] | None = None,
) -> ChunkPlan:
    """Plans the chunking, attention windows and output gather for one batch of audios.

    Args:
      feature_lens: [A] host mel-frame counts (0 allowed: that audio yields no tokens).
      cfg: the encoder config.
      num_frames: frames of the feature array; `sum(feature_lens)` or `frame_bucket` of it.
        None means `sum(feature_lens)`.
      window_buckets: window counts programs are compiled for (default `WINDOW_BUCKETS`).

    Raises:
      TypeError / ValueError: invalid lengths, a frame count that does not fit them, or more
        windows than the largest bucket.
    """
    lens = check_feature_lens(feature_lens)
    total = int(lens.sum())
    num_frames = total if num_frames is None else jaxsync.host_int(num_frames, name="num_frames")
    if num_frames not in (total, frame_bucket(total)):
        raise ValueError(
            f"feature_lens sum to {total} frames but the features have {num_frames}; expected "
            f"{total} (unpadded) or {frame_bucket(total)} (padded to frame_bucket)"
        )
    per_win, win_tok, chunk = cfg.chunks_per_window, cfg.window_tokens, cfg.chunk_len
    num_audio = lens.size

    counts = (lens + chunk - 1) // chunk  # [A]
    first_chunk = np.cumsum(counts) - counts
    audio_of_chunk = np.repeat(np.arange(num_audio), counts)  # [C]
    k = np.arange(int(counts.sum())) - first_chunk[audio_of_chunk]  # chunk index within its audio
    chunk_lens = np.minimum(chunk, lens[audio_of_chunk] - chunk * k)
    chunk_starts = (np.cumsum(lens) - lens)[audio_of_chunk] + chunk * k
    chunk_tokens = _conv1(_conv1(_conv1(chunk_lens)))

    windows = (counts + per_win - 1) // per_win  # [A]
    first_window = np.cumsum(windows) - windows
    num_windows = int(windows.sum())
    # At least one window slot, so an all-empty batch still has a valid (zero) program.
    bucket = jaxsync.bucket(max(num_windows, 1), window_buckets or WINDOW_BUCKETS)
    slots = first_window[audio_of_chunk] * per_win + k
    slot_starts, slot_lens, slot_tokens = (np.zeros(bucket * per_win, np.int64) for _ in range(3))
    slot_starts[slots], slot_lens[slots], slot_tokens[slots] = (
        chunk_starts,
        chunk_lens,
        chunk_tokens,
    )

    tokens = np.zeros(num_audio, np.int64)
    np.add.at(tokens, audio_of_chunk, chunk_tokens)
    offsets = np.cumsum(tokens) - tokens
    audio_of_token = np.repeat(np.arange(num_audio), tokens)  # [T]
    t = np.arange(int(tokens.sum())) - offsets[audio_of_token]  # token index within its audio
    out_src = np.full(bucket * win_tok, bucket * win_tok, np.int64)
    out_src[: t.size] = first_window[audio_of_token] * win_tok + t
    token_windows = first_window[audio_of_token] + t // win_tok
    window_lens = np.bincount(token_windows, minlength=bucket)
    window_ranks = np.full(bucket, bucket, np.int64)
    nonempty = windows > 0
    window_ranks[:num_windows] = np.repeat(np.arange(int(nonempty.sum())), windows[nonempty])

    longest = int(chunk_lens.max()) if chunk_lens.size else 0
    conv_limits = np.array([_conv1(longest), _conv1(_conv1(longest))], np.int64)
    return ChunkPlan(
        feature_lens=lens,
        chunk_counts=counts,
        chunk_lens=chunk_lens,
        chunk_starts=chunk_starts,
        chunk_tokens=chunk_tokens,
        chunk_slots=slots,
        audio_tokens=tokens,
        audio_offsets=offsets,
        window_counts=windows,
        window_lens=window_lens,
        window_ranks=window_ranks,
        token_windows=token_windows,
        slot_starts=slot_starts,
        slot_lens=slot_lens,
        slot_tokens=slot_tokens,
        out_src=out_src,
        conv_limits=conv_limits,
        num_frames=num_frames,
        num_windows=num_windows,
        window_bucket=bucket,
    )


def pad_features(features: Any, feature_lens: Any) -> np.ndarray:
    """Host helper: zero-pads [F, sum(lens)] features to [F, frame_bucket(sum(lens))] float32."""
    feats = jaxsync.host_array(features, name="features", ndim=2)
    total = int(check_feature_lens(feature_lens).sum())
    if feats.shape[-1] != total:
        raise ValueError(f"features have {feats.shape[-1]} frames, feature_lens sum to {total}")
    out = np.zeros((feats.shape[0], frame_bucket(total)), np.float32)
    out[:, :total] = feats
    return out
