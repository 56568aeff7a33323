"""Host side of the log-mel front end: waveform checks, staging and the per-call plan (NumPy
only).

A plan's `meta` goes up in one `jaxsync.upload_packed`; lengths and frame counts stay on the
host. Device waveforms are checked by shape and dtype only (their values are reported by the
on-device `finite` flag).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

import jaxsync
from jaxsync._fill import fill_rows
from jaxsync._host import host_array, host_int, host_ints
from jaxsync.models.voxtral._config import MelConfig


FloorMode = Literal["global", "per_audio", "per_example"]


def resolve_floor(config: MelConfig, floor: FloorMode | None) -> FloorMode:
    """Default floor: the configured global max when set, else the per-audio max (vLLM)."""
    if not isinstance(config, MelConfig):
        raise TypeError(f"config must be a MelConfig, got {type(config).__name__}")
    if floor is None:
        return "global" if config.floor_value is not None else "per_audio"
    if floor not in ("global", "per_audio", "per_example"):
        raise ValueError(f"floor must be 'global', 'per_audio' or 'per_example', got {floor!r}")
    if floor == "global" and config.floor_value is None:
        raise ValueError("floor='global' needs a truthy float config.global_log_mel_max")
    return floor


def num_stft_frames(signal: np.ndarray | int, config: MelConfig) -> np.ndarray | int:
    """Frames of `torch.stft(center=True)` on `signal` samples, less the dropped last one.

    `1 + (signal + 2 * (n_fft // 2) - n_fft) // hop - 1`: `signal // hop` for an even n_fft,
    `(signal - 1) // hop` for an odd one.
    """
    return (signal - config.n_fft % 2) // config.hop_length


def check_waveforms(
    waveforms: Any, lengths: Any, config: MelConfig, *, sampling_rate: int | None
) -> tuple[np.ndarray | jax.Array, np.ndarray]:
    """Validates a `[B, W]` (or `[W]`) batch and its host lengths; returns `(batch, lengths)`.

    Host data is converted (numpy, lists, torch CPU tensors); its samples are checked for NaN
    and inf as they are copied into their bucket (`stage_batch`), before any upload. Device
    data is checked by shape and dtype only.
    """
    check_rate(sampling_rate, config)
    on_device = isinstance(waveforms, jax.Array)
    if on_device:
        check_live(waveforms, name="waveforms")
    else:
        waveforms = host_array(waveforms, name="waveforms")
    if not np.issubdtype(waveforms.dtype, np.floating):
        raise TypeError(f"waveforms must be floating point, got {waveforms.dtype}")
    if waveforms.ndim == 1:
        waveforms = waveforms[None, :]
    if waveforms.ndim != 2:
        raise ValueError(f"waveforms must be [B, W] (mono), got shape {waveforms.shape}")
    b, w = waveforms.shape
    if b == 0:
        raise ValueError("empty batch: no waveforms")
    if lengths is None:
        lens = np.full(b, w, np.int64)
    else:
        lens = host_ints(lengths, name="lengths", minimum=None)
        if lens.shape != (b,):
            raise ValueError(f"lengths must be {b} host ints (one per waveform), got {lens!r}")
    _check_lengths(lens)
    if (lens > w).any():
        raise ValueError(f"lengths {lens.tolist()} exceed the buffer width {w}")
    return waveforms, lens


def check_audio_list(
    audio: Sequence[Any], config: MelConfig, *, sampling_rate: int | None
) -> tuple[list[np.ndarray], np.ndarray]:
    """Validates a list of 1-D host waveforms (vLLM's form); returns `(rows, lengths)`.

    The rows stay as given: `stage_batch` copies them straight into their bucket (and checks
    their samples there), with no padded copy of the whole batch first.
    """
    check_rate(sampling_rate, config)
    rows = [host_array(a, name=f"audio[{i}]", ndim=1) for i, a in enumerate(audio)]
    if not rows:
        raise ValueError("empty batch: no audio")
    for i, r in enumerate(rows):
        if not np.issubdtype(r.dtype, np.floating):
            raise TypeError(f"waveforms must be floating point, got {r.dtype} in audio[{i}]")
    lens = np.array([len(r) for r in rows], np.int64)
    _check_lengths(lens)
    return rows, lens


def check_rate(sampling_rate: Any, config: MelConfig) -> None:
    """Refuses a given `sampling_rate` other than the front end's (ValueError)."""
    if sampling_rate is not None:
        sr = host_int(sampling_rate, name="sampling_rate")
        if sr != config.sampling_rate:
            raise ValueError(
                f"waveforms are sampled at {sr} Hz but the front end expects "
                f"{config.sampling_rate} Hz; resample first"
            )


def _check_lengths(lens: np.ndarray) -> None:
    if (lens <= 0).any():
        raise ValueError(
            f"empty audio: waveforms {np.flatnonzero(lens <= 0).tolist()} have length <= 0"
        )


def check_live(x: jax.Array, *, name: str) -> None:
    """A deleted (e.g. donated) device array is refused by name (host metadata: no sync)."""
    if not isinstance(x, jax.core.Tracer) and x.is_deleted():
        raise ValueError(f"{name} was deleted (donated to another program?): pass a live array")


def host_buckets(lens: np.ndarray, hop: int) -> tuple[int, int]:
    """`(B_pad, W_pad)` of a host batch: power-of-two batch, power-of-two hops (>= 16)."""
    return jaxsync.bucket(len(lens), minimum=1), jaxsync.bucket(
        -(-int(lens.max()) // hop), minimum=16
    ) * hop


def host_batch(
    waveforms: np.ndarray | Sequence[np.ndarray], lens: np.ndarray, shape: tuple[int, int],
    out: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """A host batch (`[B, W]`, or a list of 1-D rows) copied into its bucket `shape` `[B_pad,
    W_pad]` float32 (zeros after each length), in `out` (every element written) or a new buffer.

    Raises:
      ValueError: a real sample is NaN or inf (or too large for float32). Checked as it is
        copied, in the same pass (rows on a thread pool when large); padding past a row's
        length is never read.
    """
    out = np.empty(shape, np.float32) if out is None else out
    bad = fill_rows(out, waveforms, lens.tolist(), check_finite=True)
    if bad:
        raise ValueError(f"waveforms {bad} contain NaN or inf samples")
    return out


def stage_batch(
    waveforms: np.ndarray | Sequence[np.ndarray],
    lens: np.ndarray,
    shape: tuple[int, int],
    placement: Any,
) -> np.ndarray:
    """`host_batch` written (and checked) straight into a staging buffer of `shape`, not yet
    uploaded: the caller passes it to `default_staging.upload`, or to `release` if it stops."""
    return jaxsync.default_staging.fill(
        shape, np.float32, lambda out: host_batch(waveforms, lens, shape, out=out),
        placement=placement,
    )  # fmt: skip


class MelMeta(NamedTuple):
    """What `log_mel_rows` reads on the device (int32 host arrays, one packed upload).

    Attributes:
      length: [B_pad] real samples per waveform (0 for a padding waveform).
      signal: [B_pad] samples of the zero-padded signal the STFT sees.
      row_audio: [R] waveform of each output row (>= B_pad: a padding row, no waveform's).
      row_frame0: [R] first frame of each row in its waveform's signal.
      row_frames: [R] valid frames of each row (0 for a padding row).
    """

    length: np.ndarray
    signal: np.ndarray
    row_audio: np.ndarray
    row_frame0: np.ndarray
    row_frames: np.ndarray


class MelPlan(NamedTuple):
    """Host plan of one padded waveform batch, one output row per waveform.

    Attributes:
      meta: the device metadata (`jaxsync.upload_packed(plan)`).
      samples: real samples per waveform `[B]` (after truncation for per_example).
      signal: signal samples per waveform `[B]`.
      num_frames: valid frames per waveform `[B]`.
      frames: static frames T per output row.
      floor_value: `g - 8.0` for the global floor, else None (dynamic max).
    """

    meta: MelMeta
    samples: np.ndarray
    signal: np.ndarray
    num_frames: np.ndarray
    frames: int
    floor_value: float | None


def plan_log_mel(
    lens: np.ndarray,
    width: int,
    batch_pad: int,
    config: MelConfig,
    *,
    floor: FloorMode,
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
) -> MelPlan:
    """Signals, frame counts and one row per waveform of a `[batch_pad, width]` buffer."""
    b = len(lens)
    half = config.n_fft // 2
    if pad_to_multiple_of is not None:
        pad_to_multiple_of = host_int(pad_to_multiple_of, name="pad_to_multiple_of")
        if pad_to_multiple_of <= 0:
            raise ValueError(f"pad_to_multiple_of must be positive, got {pad_to_multiple_of}")
    if floor == "per_example":
        if pad_to_multiple_of is not None:
            raise ValueError("pad_to_multiple_of does not apply to floor='per_example'")
        max_length = config.n_samples if max_length is None else max_length
        max_length = host_int(max_length, name="max_length")
        if max_length <= half:
            raise ValueError(f"max_length {max_length} must exceed n_fft // 2 = {half}")
        lens = np.minimum(lens, max_length)  # HF truncation=True
        signal = np.full(b, max_length, np.int64)
        frames = num_stft_frames(max_length, config)
    else:
        if max_length is not None:
            raise ValueError("max_length applies to floor='per_example' only")
        signal, span = lens.copy(), width
        if pad_to_multiple_of is not None:
            signal = -(-lens // pad_to_multiple_of) * pad_to_multiple_of
            span = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        short = np.flatnonzero(signal <= half)
        if short.size:
            raise ValueError(
                f"waveforms {short.tolist()} are shorter than n_fft // 2 + 1 = {half + 1} "
                "samples: centre reflect padding is undefined (torch.stft raises too); pad "
                "them or use floor='per_example'"
            )
        frames = num_stft_frames(span, config)
    num_frames = num_stft_frames(signal, config)
    pad = batch_pad - b
    meta = MelMeta(
        length=np.concatenate([lens, np.zeros(pad, np.int64)]),
        # Padding waveforms: silent signals long enough to reflect (never read: length 0).
        signal=np.concatenate([signal, np.full(pad, 1 << 12, np.int64)]),
        row_audio=np.arange(batch_pad),
        row_frame0=np.zeros(batch_pad, np.int64),
        row_frames=np.concatenate([num_frames, np.zeros(pad, np.int64)]),
    )
    meta = MelMeta(*(v.astype(np.int32) for v in meta))
    floor_value = config.floor_value if floor == "global" else None
    return MelPlan(meta, lens, signal, num_frames, int(frames), floor_value)


def front_end(
    num_mel_bins: int, mel_config: MelConfig | None, chunk_buckets: Sequence[int] | None
) -> tuple[MelConfig, tuple[int, ...] | None]:
    """An entry's front-end options, checked: (mel config, chunk buckets).

    Raises:
      TypeError / ValueError: not a `MelConfig`, other mel bins than the model's, an odd n_fft,
        chunk buckets that are not ints >= 1 or empty.
    """
    mel_config = MelConfig(num_mel_bins=num_mel_bins) if mel_config is None else mel_config
    if not isinstance(mel_config, MelConfig):
        raise TypeError(f"mel_config must be a MelConfig or None, got {type(mel_config).__name__}")
    if mel_config.num_mel_bins != num_mel_bins:
        raise ValueError(
            f"mel_config has {mel_config.num_mel_bins} mel bins, the encoder expects {num_mel_bins}"
        )
    if mel_config.n_fft % 2:
        raise ValueError(
            f"n_fft={mel_config.n_fft} is odd: torch.stft then yields one frame less per "
            "signal, so 30 s windows would not fill (use log_mel_spectrogram for odd n_fft)"
        )
    if chunk_buckets is not None:
        sizes = host_ints(chunk_buckets, name="chunk_buckets", minimum=1)
        chunk_buckets = tuple(int(b) for b in sizes)
        if not chunk_buckets:
            raise ValueError("chunk_buckets is empty")
    return mel_config, chunk_buckets
