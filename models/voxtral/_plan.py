"""Host planning of the Voxtral encoder (NumPy only): which 30-second window ("chunk") belongs to
which audio, every static pad picked from buckets, and the metadata the forward reads.

Two input kinds, one plan type each:
* `plan(num_chunks, cfg)`: the processor's `input_features` windows, `num_chunks[i]`
  consecutive windows per item -> `VoxtralPlan` for `forward`.
* `plan_waveforms(lengths, cfg, mel_config)` (`_waveform_plan.py`): raw audio, each zero-padded
  to whole windows and turned into log-mel windows on the device -> `VoxtralWaveformPlan` for
  `forward_waveforms`.

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
from jaxsync._plans import content_key
from jaxsync.models.voxtral._config import MelConfig, VoxtralAudioConfig
from jaxsync.models.voxtral._mel_plan import check_rate


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


def features_planner(
    num_chunks: Any, cfg: VoxtralAudioConfig, buckets: Sequence[int] | None, project: bool
):
    """`planner(features, where)` of `TowerEntry.run` for features with `num_chunks` windows
    per item (None: one item per window): the plan cached per content of `num_chunks`, so a
    repeated call costs the key (the checks run on a miss)."""

    def planner(features: Any, where: Any):
        on_device = isinstance(features, jax.Array)
        rows = 1 if features.ndim == 2 else features.shape[0]  # [F, 2P]: one window
        key, chunks = ("ones",), None
        if num_chunks is not None:
            key, chunks = content_key(num_chunks, check_num_chunks)

        def build() -> VoxtralPlan:
            return plan_features(chunks, rows, cfg, buckets=buckets, on_device=on_device,
                                 project=project)  # fmt: skip

        return ("features", key, rows, on_device, where), build

    return planner


def audio_given(
    audio: Any, lengths: Any, input_features: Any, num_chunks: Any, attention_mask: Any,
    sampling_rate: Any, mel_config: MelConfig,
) -> bool:  # fmt: skip
    """Whether an entry call passes raw audio (else the processor's features).

    Raises:
      ValueError: both inputs or neither, an argument of the other input's, or a
        `sampling_rate` other than the front end's.
    """
    if (audio is None) == (input_features is None):
        raise ValueError("pass exactly one of audio= and input_features=")
    if input_features is None:
        if num_chunks is not None or attention_mask is not None:
            raise ValueError("num_chunks and attention_mask go with input_features=")
        check_rate(sampling_rate, mel_config)
        return True
    if lengths is not None or sampling_rate is not None:
        raise ValueError("lengths and sampling_rate go with audio=, not input_features=")
    return False
