"""Host planning of raw audio for `forward_waveforms` (NumPy only): every audio zero-padded to
whole 30-second windows, one log-mel window per encoder window, the waveform buffer's static
sizes picked from buckets, and the metadata the on-device log-mel and the encoder read. The
window tables follow `plan`'s (`_plan.py`), so both input kinds share the encoder's rows.

The Voxtral processor (and mistral-common ahead of vLLM) zero-pads every audio to a multiple of
30 s, computes the log-mel of the whole padded audio (its dynamic-range max spans all its
windows), cuts it into windows of `2 * max_source_positions` frames and encodes the stacked
windows. Here the windows are the rows of the on-device log-mel, so no per-audio spectrogram of
the padded batch width is built, and the per-audio max is a segment max over its windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import jaxsync
from jaxsync._calls import reads
from jaxsync._host import host_ints
from jaxsync.models.voxtral._config import MelConfig, VoxtralAudioConfig
from jaxsync.models.voxtral._mel import MelSpec
from jaxsync.models.voxtral._mel_plan import (
    check_audio_list,
    check_waveforms,
    plan_log_mel,
    resolve_floor,
)
from jaxsync.models.voxtral._plan import rows_per_chunk, window_bucket


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


def batch_layout(
    x: Any, lens: np.ndarray, config: MelConfig, chunk_buckets: Sequence[int] | None
) -> tuple[WaveformBuckets, tuple[int, ...]]:
    """(buckets, padded shape) of a checked waveform batch: a device batch is its own bucket
    (the caller's buffer is the bucket)."""
    if isinstance(x, jax.Array):
        return WaveformBuckets(chunk_buckets, (x.shape[0],), (x.shape[1],)), tuple(x.shape)
    buckets = WaveformBuckets(chunk_buckets)
    return buckets, waveform_shape(lens, config, buckets)


def waveform_planner(
    lens: np.ndarray, cfg: VoxtralAudioConfig, mel_config: MelConfig, *,
    chunk_buckets: Sequence[int] | None, project: bool,
):  # fmt: skip
    """`planner(x, where) -> (plan key, plan build, padded shape)` of a checked waveform batch
    `x` of `lens` samples per audio (`batch_layout`: a device batch is its own bucket)."""

    def planner(x: Any, where: Any):
        buckets, shape = batch_layout(x, lens, mel_config, chunk_buckets)

        def build() -> VoxtralWaveformPlan:
            return plan_waveforms(lens, cfg, mel_config, buckets=buckets, project=project)

        return ("audio", lens.tobytes(), shape, where), build, shape

    return planner


def front_end_spec(mel_config: MelConfig, chunk_frames: int) -> MelSpec:
    """The encoder's static log-mel settings: one window of `chunk_frames` frames per row,
    floored at the configured global max when set, else at the per-audio max."""
    floor = mel_config.floor_value if resolve_floor(mel_config, None) == "global" else None
    return MelSpec(mel_config, chunk_frames, floor)


@reads("live", "dtype", "shape", "metadata")
def audio_inputs(
    audio: Any, lengths: Any, config: MelConfig, *, sampling_rate: int | None = None
) -> tuple[Any, np.ndarray]:
    """`(batch, lengths)` of raw audio, checked: a list of 1-D host waveforms (kept as rows,
    copied straight into their bucket when staged) or a padded `[B, W]` batch with host
    `lengths`. What it reads of a device batch is declared for the call key."""
    if isinstance(audio, list | tuple):
        if lengths is not None:
            raise ValueError("lengths go with a padded [B, W] batch, not a list of audios")
        return check_audio_list(audio, config, sampling_rate=sampling_rate)
    return check_waveforms(audio, lengths, config, sampling_rate=sampling_rate)
