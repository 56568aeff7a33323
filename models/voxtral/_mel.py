"""On-device Whisper log-mel spectrogram, batched over padded waveforms with host-side lengths.

Upstream computes it per waveform with `torch.stft` (vLLM `compute_whisper_melspec`, transformers
Whisper / Voxtral-Realtime feature extractors). Here one jitted program takes a padded batch
`[B, W]` plus host metadata (uploaded once, packed) and produces any set of frame windows ("rows")
of any waveform, so the same core serves the plain front end (one row per waveform) and the
encoder path (one row per 30-second window).

Lengths, signals and the dynamic-range floor (the three upstream variants):
  * `lengths[i]` is the number of real samples of waveform i; buffer samples at or after it are
    never read (they may hold garbage, NaN included).
  * The *signal* the STFT sees is the real audio zero-padded to `signal[i] >= lengths[i]` samples.
    The STFT reflects at the signal end, like `torch.stft(center=True)` on that signal, and the
    signal has `signal[i] // hop` frames (the last STFT frame is dropped, as upstream).
  * floor="global": `max(log, g - 8)` with the configured `global_log_mel_max` (vLLM post-PR,
    Voxtral-Realtime). signal = audio (or padded to `pad_to_multiple_of`).
  * floor="per_audio": `max(log, max_over_signal_frames(log) - 8)` per waveform (vLLM, and the
    Voxtral processor with `pad_to_multiple_of=480000`: its max includes the padded frames).
  * floor="per_example": transformers' Whisper batch path: every example is truncated or
    zero-padded to `max_length` samples (default 30 s) and the max is per example over all of those
    frames, padded ones included.
  In every variant the result depends only on (audio samples, lengths, signal lengths): neither the
  buffer width, the batch composition, nor bucket padding changes a valid frame.

Precision: the power spectrum is float64 where the backend has it natively (`_spectrum.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
import jaxsync.check
from jaxsync.models.voxtral._config import MelConfig
from jaxsync.models.voxtral._filters import device_tables
from jaxsync.models.voxtral._spectrum import power_spectrum, spectral_float64


FloorMode = Literal["global", "per_audio", "per_example"]


@dataclasses.dataclass(frozen=True)
class MelSpec:
    """Static (compile-time) part of a mel call.

    Attributes:
      n_fft: FFT / window size.
      hop: hop length.
      frames: frames T per output row.
      floor_value: `g - 8.0` for the global floor (a compile-time float, no device scalar), or
        None for the dynamic max.
      float64: power spectrum in float64 (`spectral_float64` of the waveforms' platform).
    """

    n_fft: int
    hop: int
    frames: int
    floor_value: float | None
    float64: bool = False


def log_mel_rows(
    x: jax.Array, meta: jaxsync.Packed, filters: jax.Array, window: jax.Array, *, spec: MelSpec
) -> tuple[jax.Array, jax.Array]:
    """Traceable core: log-mel frames of selected windows of a padded waveform batch.

    Args:
      x: `[B, W]` padded waveforms.
      meta: packed int32 fields: `length` [B] real samples, `signal` [B] signal samples,
        `row_audio` [R] waveform of each row, `row_frame0` [R] first frame of the row,
        `row_frames` [R] valid frames of the row (0 for a padding row).
      filters: `[n_fft // 2 + 1, F]` float32 mel filters.
      window: `[2, n_fft]` float32 window and its float32 rounding residual (`device_tables`).
      spec: static settings.

    Returns:
      `[R, F, T]` features (invalid frames are 0.0) and `[B]` bool: every real sample is finite.
    """
    x = x.astype(jnp.float32)
    b, w = x.shape
    length, signal = meta["length"], meta["signal"]  # [B], [B]
    row_audio, frame0, row_frames = meta["row_audio"], meta["row_frame0"], meta["row_frames"]
    n_rows = row_audio.shape[0]
    nblk = -(-spec.n_fft // spec.hop)  # hops spanned by one window
    seg = (spec.frames + nblk) * spec.hop
    # Position in the signal of every sample the row's windows touch; centre padding = n_fft // 2.
    q = frame0[:, None] * spec.hop + jnp.arange(seg, dtype=jnp.int32)[None, :] - spec.n_fft // 2
    sig = signal[row_audio][:, None]  # [R, 1]
    q = jnp.where(q < 0, -q, q)  # reflect about the first sample
    q = jnp.where(q >= sig, 2 * (sig - 1) - q, q)  # reflect about the last signal sample
    real = (q >= 0) & (q < length[row_audio][:, None])  # beyond the audio the signal is zero
    src = jnp.clip(q, 0, w - 1)
    samples = jnp.where(real, x[row_audio[:, None], src], 0.0)  # [R, seg]
    # Framing without a per-sample gather: window t = hops t .. t + nblk - 1, truncated to n_fft.
    blocks = samples.reshape(n_rows, spec.frames + nblk, spec.hop)
    frames = jnp.concatenate([blocks[:, i : i + spec.frames] for i in range(nblk)], axis=-1)
    frames = frames[..., : spec.n_fft]  # [R, T, n_fft], exact float32 samples
    power = power_spectrum(frames, window, float64=spec.float64)  # [R, T, n_fft // 2 + 1]
    # Full fp32 even where TF32 is the default: the filters' low bins span 7 decades.
    mel = jnp.einsum("rtk,kf->rft", power, filters, precision=jax.lax.Precision.HIGHEST)
    log = jnp.log10(jnp.maximum(mel, 1e-10))  # [R, F, T]
    valid = jnp.arange(spec.frames, dtype=jnp.int32)[None, :] < row_frames[:, None]  # [R, T]
    if spec.floor_value is None:
        row_max = jnp.max(jnp.where(valid[:, None, :], log, -jnp.inf), axis=(1, 2))  # [R]
        # A waveform's max spans all of its rows (e.g. all 30 s windows of one audio).
        audio_max = jax.ops.segment_max(row_max, row_audio, num_segments=b)  # [B]
        log = jnp.maximum(log, (audio_max[row_audio] - 8.0)[:, None, None])
    else:
        log = jnp.maximum(log, np.float32(spec.floor_value))
    out = jnp.where(valid[:, None, :], (log + 4.0) / 4.0, 0.0)
    finite = jnp.all(
        jnp.isfinite(x) | (jnp.arange(w, dtype=jnp.int32)[None, :] >= length[:, None]), axis=1
    )
    return out, finite


_log_mel_jit = jax.jit(log_mel_rows, static_argnames=("spec",))


@dataclasses.dataclass(frozen=True)
class WaveformPlan:
    """Host-side plan of one padded waveform batch (all numpy; nothing read from the device).

    Attributes:
      x: the waveform batch on the device, `[B_pad, W]`.
      lengths: real samples per waveform `[B]` (after truncation for per_example).
      signal: signal samples per waveform `[B]`.
      batch: B (rows at or after it in `x` are bucket padding).
    """

    x: jax.Array
    lengths: np.ndarray
    signal: np.ndarray
    batch: int

    def audio_fields(self) -> dict[str, np.ndarray]:
        """`length` / `signal` over the padded batch (padding waveforms: silent, n_fft samples)."""
        pad = self.x.shape[0] - self.batch
        length = np.concatenate([self.lengths, np.zeros(pad, np.int64)]).astype(np.int32)
        signal = np.concatenate([self.signal, np.full(pad, 1 << 12, np.int64)]).astype(np.int32)
        return {"length": length, "signal": signal}


def resolve_floor(config: MelConfig, floor: FloorMode | None) -> FloorMode:
    """Default floor: the configured global max when set, else the per-audio max (vLLM)."""
    if floor is None:
        return "global" if config.floor_value is not None else "per_audio"
    if floor not in ("global", "per_audio", "per_example"):
        raise ValueError(f"floor must be 'global', 'per_audio' or 'per_example', got {floor!r}")
    if floor == "global" and config.floor_value is None:
        raise ValueError("floor='global' needs a truthy float config.global_log_mel_max")
    return floor


def plan_waveforms(
    waveforms: np.ndarray | jax.Array,
    lengths: Sequence[int] | np.ndarray | None,
    config: MelConfig,
    *,
    floor: FloorMode,
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
    sampling_rate: int | None = None,
    placement=None,
) -> WaveformPlan:
    """Validates host metadata, pads a host batch to its bucket and uploads it (one transfer).

    Host NumPy waveforms are checked for NaN/inf here (host data: no device read). A device
    `jax.Array` is used as given (its width is the caller's bucket) and is *not* checked on the
    host, since that would be a device read; the `finite` flag computed on the device reports it.
    """
    if sampling_rate is not None and sampling_rate != config.sampling_rate:
        raise ValueError(
            f"waveforms are sampled at {sampling_rate} Hz but the front end expects "
            f"{config.sampling_rate} Hz; resample first"
        )
    on_device = isinstance(waveforms, jax.Array)
    if not on_device:
        waveforms = np.asarray(waveforms)
        if not np.issubdtype(waveforms.dtype, np.floating):
            raise TypeError(f"waveforms must be floating point, got {waveforms.dtype}")
    if waveforms.ndim == 1:
        waveforms = waveforms[None, :]
    if waveforms.ndim != 2:
        raise ValueError(f"waveforms must be [B, W] (mono), got shape {waveforms.shape}")
    b, w = waveforms.shape
    if b == 0:
        raise ValueError("empty batch: no waveforms")
    lens = np.full(b, w, np.int64) if lengths is None else np.asarray(lengths)
    if lens.shape != (b,) or not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"lengths must be {b} host ints, got {lens!r}")
    lens = lens.astype(np.int64)
    if (lens <= 0).any():
        raise ValueError(
            f"empty audio: waveforms {np.flatnonzero(lens <= 0).tolist()} have length 0"
        )
    if (lens > w).any():
        raise ValueError(f"lengths {lens.tolist()} exceed the buffer width {w}")
    if floor == "per_example":
        if pad_to_multiple_of is not None:
            raise ValueError("pad_to_multiple_of does not apply to floor='per_example'")
        max_length = config.n_samples if max_length is None else int(max_length)
        if max_length <= config.n_fft // 2:
            raise ValueError(
                f"max_length {max_length} must exceed n_fft // 2 = {config.n_fft // 2}"
            )
        lens = np.minimum(lens, max_length)  # HF truncation=True
        signal = np.full(b, max_length, np.int64)
    else:
        if max_length is not None:
            raise ValueError("max_length applies to floor='per_example' only")
        signal = lens.copy()
        if pad_to_multiple_of is not None:
            if pad_to_multiple_of <= 0:
                raise ValueError(f"pad_to_multiple_of must be positive, got {pad_to_multiple_of}")
            signal = -(-lens // pad_to_multiple_of) * pad_to_multiple_of
        short = np.flatnonzero(signal <= config.n_fft // 2)
        if short.size:
            raise ValueError(
                f"waveforms {short.tolist()} are shorter than n_fft // 2 + 1 = "
                f"{config.n_fft // 2 + 1} samples: centre reflect padding is undefined "
                "(torch.stft raises too); pad them or use floor='per_example'"
            )
    if on_device:
        x = waveforms
    else:
        bad = [i for i in range(b) if not np.isfinite(waveforms[i, : lens[i]]).all()]
        if bad:
            raise ValueError(f"waveforms {bad} contain NaN or inf samples")
        hop = config.hop_length
        width = jaxsync.bucket(-(-int(lens.max()) // hop), minimum=16) * hop
        host = np.zeros((jaxsync.bucket(b, minimum=1), width), np.float32)
        for i in range(b):
            host[i, : lens[i]] = waveforms[i, : lens[i]]
        x = jaxsync.async_h2d(host, placement=placement, copy=False)  # `host` is ours alone
    return WaveformPlan(x=x, lengths=lens, signal=signal, batch=b)


class LogMel(NamedTuple):
    """Result of `log_mel_spectrogram`.

    Attributes:
      features: `[B_pad, F, T]` device float32; rows >= len(num_frames) and frames
        >= num_frames[i] are padding (0.0).
      finite: `[B_pad]` device bool: every real sample of the waveform was finite (read it
        whenever convenient; the call itself never waits for it).
      num_frames: `[B]` host int: valid frames per waveform (`signal // hop_length`).
    """

    features: jax.Array
    finite: jax.Array
    num_frames: np.ndarray


@jaxsync.check.entry_point
def log_mel_spectrogram(
    waveforms: np.ndarray | jax.Array,
    lengths: Sequence[int] | np.ndarray | None = None,
    *,
    config: MelConfig,
    floor: FloorMode | None = None,
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
    sampling_rate: int | None = None,
    placement=None,
) -> LogMel:
    """Whisper log-mel features of a batch of padded waveforms in one jitted program.

    Args:
      waveforms: `[B, W]` (or `[W]`) float waveforms, host NumPy or a device array.
      lengths: host ints `[B]`, real samples per waveform (default: W for all).
      config: front-end config.
      floor: "global", "per_audio" or "per_example" (module docstring); default "global" when
        `config.global_log_mel_max` is set, else "per_audio".
      pad_to_multiple_of: zero-pad each signal to a multiple of this many samples (Voxtral
        processor: 480000); global / per_audio only.
      max_length: per_example only: samples every example is truncated / padded to (default
        `config.n_samples`, 30 s).
      sampling_rate: if given, must equal `config.sampling_rate`.
      placement: device or sharding for the upload and the constant tables.

    Returns:
      `LogMel` with padded device features and host frame counts.

    Raises:
      ValueError: empty or too-short audio, lengths out of range, NaN/inf in host waveforms,
        a sampling-rate mismatch, or floor="global" without a configured max.
    """
    floor = resolve_floor(config, floor)
    plan = plan_waveforms(
        waveforms, lengths, config, floor=floor, pad_to_multiple_of=pad_to_multiple_of,
        max_length=max_length, sampling_rate=sampling_rate, placement=placement,
    )  # fmt: skip
    hop = config.hop_length
    b_pad, w = plan.x.shape
    if floor == "per_example":
        frames = int(plan.signal[0]) // hop
    elif pad_to_multiple_of is not None:
        frames = -(-w // pad_to_multiple_of) * pad_to_multiple_of // hop
    else:
        frames = w // hop
    fields = plan.audio_fields()
    num_frames = plan.signal // hop
    fields["row_audio"] = np.arange(b_pad, dtype=np.int32)
    fields["row_frame0"] = np.zeros(b_pad, np.int32)
    fields["row_frames"] = np.concatenate([num_frames, np.zeros(b_pad - plan.batch, np.int64)])
    meta = jaxsync.upload_packed(fields, placement=placement)
    filters, window = device_tables(config, placement)
    floor_value = config.floor_value if floor == "global" else None
    spec = MelSpec(config.n_fft, hop, frames, floor_value, spectral_float64(plan.x))
    feats, finite = _log_mel_jit(plan.x, meta, filters, window, spec=spec)
    return LogMel(features=feats, finite=finite, num_frames=num_frames)
