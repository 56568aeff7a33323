"""Host planning of the Voxtral encoder (NumPy only): which 30-second window ("chunk") belongs to
which audio, every static pad picked from buckets, and the metadata the forward reads.

Two input kinds, one plan type each:
* `plan(num_chunks, cfg)`: the processor's `input_features` windows, `num_chunks[i]`
  consecutive windows per item -> `VoxtralPlan` for `forward`.
* `plan_waveforms(lengths, cfg, mel_config)`: raw audio, each zero-padded to whole windows and
  turned into log-mel windows on the device -> `VoxtralWaveformPlan` for `forward_waveforms`.

A plan's `meta` (a NamedTuple of int32 host arrays) goes up in one `jaxsync.upload_packed(plan)`
and the forward reads it as `meta.<field>`; `plan.lengths` are the output rows of each item, in
order from row 0. The pads are the only static sizes of a program, so every item mix whose pads
fall in the same buckets shares one program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync._calls import reads
from jaxsync._host import host_ints
from jaxsync.models.voxtral._config import MelConfig, VoxtralAudioConfig
from jaxsync.models.voxtral._mel import MelSpec
from jaxsync.models.voxtral._mel_plan import plan_log_mel, resolve_floor


class VoxtralMeta(NamedTuple):
    """Device metadata of `forward` (int32).

    Attributes:
      row_audio: [C_pad] item of each window; a padding window holds I_pad (no item's).
      item_chunks: [I_pad] windows per item (0 for a padding item).
    """

    row_audio: np.ndarray
    item_chunks: np.ndarray


class VoxtralPlan(NamedTuple):
    """Host plan of one `forward` call over log-mel windows.

    Attributes:
      meta: what the forward reads on the device.
      lengths: output rows per item (`rows_per_chunk` per window).
      num_chunks: windows per item.
      chunks: C_pad, the features' static window count.
      items: I_pad, the item table's static size (the window pad: every item has a window).
      rows_per_chunk: `tokens_per_chunk` projected rows, or `max_source_positions` encoder
        rows when `project=False`.
    """

    meta: VoxtralMeta
    lengths: tuple[int, ...]
    num_chunks: tuple[int, ...]
    chunks: int
    items: int
    rows_per_chunk: int


def rows_per_chunk(cfg: VoxtralAudioConfig, project: bool) -> int:
    """Output rows of one window: projected tokens, or the encoder's frames without projector."""
    return cfg.tokens_per_chunk if project else cfg.chunk_frames // 2


def window_bucket(total: int, buckets: Sequence[int] | None, what: str) -> int:
    """The padded window count of `total` windows (powers of two by default).

    Raises:
      ValueError: more windows than the largest bucket, naming `what` they are.
    """
    if buckets is not None and total > max(buckets):
        raise ValueError(f"{total} {what} exceed the largest chunk bucket {max(buckets)}")
    return jaxsync.bucket(total, buckets, minimum=1)


def check_num_chunks(num_chunks: Any) -> np.ndarray:
    """Windows per item as host ints >= 1, at least one item."""
    counts = host_ints(num_chunks, name="num_chunks", minimum=1)
    if counts.size == 0:
        raise ValueError("num_chunks is empty")
    return counts


def plan_features(
    num_chunks: Any,
    rows: int,
    cfg: VoxtralAudioConfig,
    *,
    buckets: Sequence[int] | None,
    on_device: bool,
    project: bool,
) -> VoxtralPlan:
    """`plan` of `rows` feature windows (`num_chunks` None: one item per window). A device
    array's rows are the caller's bucket; host windows are bucketed here.

    Raises:
      ValueError: `num_chunks` summing to more windows than `rows` (or to others, on the host).
    """
    counts = np.ones(rows, np.int64) if num_chunks is None else check_num_chunks(num_chunks)
    total = int(counts.sum())
    if total > rows or (total != rows and not on_device):
        raise ValueError(f"num_chunks sums to {total} but input_features has {rows}")
    return plan(counts, cfg, buckets=(rows,) if on_device else buckets, project=project)


def features_check(cfg: VoxtralAudioConfig):
    """The check of `input_features`: `[C, F, 2P]` (or `[F, 2P]`) float, at least one window."""

    @reads("shape", "dtype")
    def check(features: Any) -> None:
        shape = tuple(features.shape)
        shape = (1, *shape) if len(shape) == 2 else shape
        want = (cfg.num_mel_bins, cfg.chunk_frames)
        if len(shape) != 3 or shape[1:] != want:
            raise ValueError(f"input_features must be [C, {want[0]}, {want[1]}], got {shape}")
        if not np.issubdtype(features.dtype, np.floating) and features.dtype != jnp.bfloat16:
            raise TypeError(f"input_features must be floating point, got {features.dtype}")
        if shape[0] == 0:
            raise ValueError("input_features has no windows")

    return check


def batch_layout(
    x: Any, lens: np.ndarray, config: MelConfig, chunk_buckets: Sequence[int] | None
) -> tuple[WaveformBuckets, tuple[int, ...]]:
    """(buckets, padded shape) of a checked waveform batch: a device batch is its own bucket."""
    if isinstance(x, jax.Array):
        return WaveformBuckets(chunk_buckets, (x.shape[0],), (x.shape[1],)), tuple(x.shape)
    buckets = WaveformBuckets(chunk_buckets)
    return buckets, waveform_shape(lens, config, buckets)


def plan(
    num_chunks: Any,
    cfg: VoxtralAudioConfig,
    *,
    buckets: Sequence[int] | None = None,
    project: bool = True,
) -> VoxtralPlan:
    """Window-to-item tables for `num_chunks[i]` consecutive windows per item.

    Args:
      num_chunks: host ints >= 1, windows per item (the Voxtral processor's windows per audio).
      cfg: the audio config.
      buckets: allowed padded window counts (default: powers of two); the item table is padded
        to the same count, so the item count adds no static size.
      project: rows of the projector (True) or of the Whisper encoder (False).

    Raises:
      ValueError / TypeError: no items, a count that is not an int >= 1, more windows than the
        largest bucket.
    """
    counts = check_num_chunks(num_chunks)
    total = int(counts.sum())
    pad = window_bucket(total, buckets, "windows")
    row_audio = np.full(pad, pad, np.int32)
    row_audio[:total] = np.repeat(np.arange(counts.size), counts)
    item_chunks = np.zeros(pad, np.int32)
    item_chunks[: counts.size] = counts
    per = rows_per_chunk(cfg, project)
    lengths = tuple(int(n) * per for n in counts)
    return VoxtralPlan(
        VoxtralMeta(row_audio, item_chunks), lengths, tuple(counts.tolist()), pad, pad, per
    )


class WaveformBuckets(NamedTuple):
    """Allowed static sizes of a waveform call (None: powers of two).

    Attributes:
      windows: padded window counts (from 1).
      items: padded audio counts, the waveform buffer's rows (from 4, so 1 to 4 audios share
        one program).
      samples: padded buffer widths in samples (default: a power-of-two number of hops, from
        16).
    """

    windows: Sequence[int] | None = None
    items: Sequence[int] | None = None
    samples: Sequence[int] | None = None


def waveform_shape(
    lengths: np.ndarray, mel_config: MelConfig, buckets: WaveformBuckets | None
) -> tuple[int, int]:
    """`(B_pad, W_pad)`: the padded waveform buffer of audios of `lengths` samples."""
    buckets = WaveformBuckets() if buckets is None else buckets
    items = jaxsync.bucket(len(lengths), buckets.items, minimum=4)
    longest = int(lengths.max())
    if buckets.samples is not None:
        return items, jaxsync.bucket(longest, buckets.samples)
    hop = mel_config.hop_length
    return items, jaxsync.bucket(-(-longest // hop), minimum=16) * hop


class VoxtralWaveformMeta(NamedTuple):
    """Device metadata of `forward_waveforms` (int32): the log-mel rows' fields and the items'.

    Attributes:
      length: [B_pad] real samples per audio (0 for a padding audio).
      signal: [B_pad] samples of each audio zero-padded to whole windows.
      row_audio: [C_pad] audio of each window (B_pad for a padding window).
      row_frame0: [C_pad] first frame of each window in its audio.
      row_frames: [C_pad] valid frames of each window (0 for a padding window).
      item_chunks: [B_pad] windows per audio.
    """

    length: np.ndarray
    signal: np.ndarray
    row_audio: np.ndarray
    row_frame0: np.ndarray
    row_frames: np.ndarray
    item_chunks: np.ndarray


class VoxtralWaveformPlan(NamedTuple):
    """Host plan of one `forward_waveforms` call.

    Attributes:
      meta: what the forward reads on the device.
      lengths: output rows per audio.
      num_chunks: windows per audio.
      chunks: C_pad, the static window count.
      items: B_pad, the waveform buffer's rows.
      width: W_pad, the waveform buffer's samples per row.
      mel: the front end's static settings, `forward_waveforms(..., mel=plan.mel)`.
    """

    meta: VoxtralWaveformMeta
    lengths: tuple[int, ...]
    num_chunks: tuple[int, ...]
    chunks: int
    items: int
    width: int
    mel: MelSpec


def plan_waveforms(
    lengths: Any,
    cfg: VoxtralAudioConfig,
    mel_config: MelConfig,
    *,
    buckets: WaveformBuckets | None = None,
    project: bool = True,
) -> VoxtralWaveformPlan:
    """Every audio zero-padded to whole windows, one log-mel window per encoder window, with the
    floor the config implies (its global max, else the per-audio max over all its windows).

    Args:
      lengths: host ints >= 1, real samples per audio.
      cfg: the audio config; mel_config: the front end's.
      buckets: the allowed static sizes (`WaveformBuckets`); a caller's own `[B, W]` buffer is
        `WaveformBuckets(items=(B,), samples=(W,))`.
      project: rows of the projector (True) or of the Whisper encoder (False).

    Raises:
      ValueError / TypeError: bad lengths, audio longer than the largest width bucket, more
        windows than the largest window bucket (all before any upload).
    """
    lens = host_ints(lengths, name="lengths", minimum=1)
    if lens.size == 0:
        raise ValueError("lengths is empty: no audio")
    buckets = WaveformBuckets() if buckets is None else buckets
    items, width = waveform_shape(lens, mel_config, buckets)
    window = cfg.chunk_frames * mel_config.hop_length
    floor = resolve_floor(mel_config, None)
    mel = plan_log_mel(lens, width, items, mel_config, floor=floor, pad_to_multiple_of=window)
    counts = mel.signal // window
    total = int(counts.sum())
    pad = window_bucket(total, buckets.windows, f"windows of {window} samples")
    first = np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    row_audio = np.full(pad, items, np.int32)
    row_audio[:total] = np.repeat(np.arange(lens.size), counts)
    row_frame0 = np.zeros(pad, np.int32)
    row_frame0[:total] = (np.arange(total) - first) * cfg.chunk_frames
    row_frames = np.zeros(pad, np.int32)
    row_frames[:total] = cfg.chunk_frames
    item_chunks = np.zeros(items, np.int32)
    item_chunks[: lens.size] = counts
    meta = VoxtralWaveformMeta(
        mel.meta.length, mel.meta.signal, row_audio, row_frame0, row_frames, item_chunks
    )
    per = rows_per_chunk(cfg, project)
    spec = MelSpec(mel_config, cfg.chunk_frames, mel.floor_value)
    num_chunks = tuple(int(n) for n in counts)
    lengths_out = tuple(n * per for n in num_chunks)
    return VoxtralWaveformPlan(meta, lengths_out, num_chunks, pad, items, width, spec)
