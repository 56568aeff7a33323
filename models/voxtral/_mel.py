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
    signal has torch's frame count less the last frame, as upstream: `signal[i] // hop` for an
    even n_fft, `(signal[i] - 1) // hop` for an odd one.
  * floor="global": `max(log, g - 8)` with the configured `global_log_mel_max` (vLLM post-PR,
    Voxtral-Realtime). signal = audio (or padded to `pad_to_multiple_of`).
  * floor="per_audio": `max(log, max_over_signal_frames(log) - 8)` per waveform (vLLM, and the
    Voxtral processor with `pad_to_multiple_of=480000`: its max includes the padded frames).
  * floor="per_example": transformers' Whisper batch path: every example is truncated or
    zero-padded to `max_length` samples (default 30 s) and the max is per example over all of those
    frames, padded ones included.
  In every variant the result depends only on (audio samples, lengths, signal lengths): neither the
  buffer width, the batch composition, nor bucket padding changes a valid frame.

Precision: the power spectrum is float64 on CPU and GPU and float32 on TPU, chosen when the program
is lowered, not by the host that traces it (`_spectrum.py`).
"""

from __future__ import annotations

import dataclasses
import functools as ft
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
import jaxsync.check
from jaxsync._calls import CallCache, prepared_call
from jaxsync._placement import check_devices, devices_of
from jaxsync.models.voxtral._config import MelConfig
from jaxsync.models.voxtral._filters import periodic_hann, slaney_mel_filters
from jaxsync.models.voxtral._mel_plan import (
    FloorMode,
    check_waveforms,
    host_buckets,
    plan_log_mel,
    resolve_floor,
    stage_batch,
)
from jaxsync.models.voxtral._spectrum import power_spectrum


@dataclasses.dataclass(frozen=True)
class MelSpec:
    """Static (compile-time) part of a mel call.

    Attributes:
      config: the front-end config (its filter bank and window are program constants).
      frames: frames T per output row.
      floor_value: `g - 8.0` for the global floor (a compile-time float, no device scalar), or
        None for the dynamic max.
      precision: spectral precision, None = per platform at lowering (`power_spectrum`).
    """

    config: MelConfig
    frames: int
    floor_value: float | None
    precision: str | None = None


def log_mel_floor(
    log_spec: jax.Array, *, global_log_mel_max: float | None = None, valid: Any = None
) -> jax.Array:
    """The dynamic-range floor and scaling of Whisper features, as a pure traceable function.

    vLLM clamps with Python scalars (`max(log, g - 8)` with a fixed `global_log_mel_max`, else
    `max(log, log.max() - 8)`); this is that step for a server's own jit, batched.

    Args:
      log_spec: `[..., F, T]` float32 `log10(max(mel, 1e-10))`.
      global_log_mel_max: the fixed ceiling (a Python float; None or 0.0 = the dynamic max, as
        vLLM tests it for truthiness), compiled in as a constant.
      valid: optional `[..., T]` bool, the real frames: the max spans them only, and the others
        come out 0.0.

    Returns:
      `[..., F, T]` float32 `(max(log, floor) + 4) / 4`.
    """
    if global_log_mel_max is not None and not isinstance(global_log_mel_max, float):
        raise TypeError(f"global_log_mel_max must be a Python float, got {global_log_mel_max!r}")
    mask = None if valid is None else jnp.asarray(valid)[..., None, :]
    if global_log_mel_max:
        floor = np.float32(global_log_mel_max - 8.0)
    else:
        masked = log_spec if mask is None else jnp.where(mask, log_spec, -jnp.inf)
        floor = jnp.max(masked, axis=(-2, -1), keepdims=True) - 8.0
    return _scaled(log_spec, floor, mask)


def _scaled(log: jax.Array, floor: Any, mask: Any) -> jax.Array:
    out = (jnp.maximum(log, floor) + 4.0) / 4.0
    return out if mask is None else jnp.where(mask, out, 0.0)


@ft.cache
def _tables(config: MelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Program constants: float32 filters `[n_fft // 2 + 1, F]`, float64 window `[n_fft]`."""
    return slaney_mel_filters(config).astype(np.float32), periodic_hann(config.n_fft)


def log_mel_rows(x: jax.Array, meta: Any, *, spec: MelSpec) -> tuple[jax.Array, jax.Array]:
    """Traceable core: log-mel frames of selected windows of a padded waveform batch.

    Args:
      x: `[B, W]` padded waveforms.
      meta: the plan's int32 fields (`MelMeta`, uploaded or as host arrays): `length` [B]
        real samples, `signal` [B] signal samples, `row_audio` [R] waveform of each row (>= B:
        a padding row), `row_frame0` [R] first frame of the row, `row_frames` [R] valid frames
        of the row (0 for a padding row).
      spec: static settings.

    Returns:
      `[R, F, T]` features (invalid frames are 0.0) and `[B]` bool: every real sample is finite.

    Raises:
      ValueError: while tracing, waveforms of another batch size than the plan's.
    """
    cfg = spec.config
    n_fft, hop = cfg.n_fft, cfg.hop_length
    filters, window = _tables(cfg)
    length, signal = meta.length, meta.signal  # [B], [B]
    if x.ndim != 2 or x.shape[0] != length.shape[0]:
        raise ValueError(
            f"waveforms {tuple(x.shape)} do not fit the plan: it has {length.shape[0]} waveform "
            "rows ([B, W])"
        )
    x = x.astype(jnp.float32)
    b, w = x.shape
    # Host arrays (a plan made while tracing) become constants of the program.
    length, signal = jnp.asarray(length), jnp.asarray(signal)
    row_audio, frame0 = jnp.asarray(meta.row_audio), jnp.asarray(meta.row_frame0)
    row_frames = jnp.asarray(meta.row_frames)
    audio = jnp.minimum(row_audio, b - 1)  # padding rows read a real buffer row, masked below
    n_rows = row_audio.shape[0]
    nblk = -(-n_fft // hop)  # hops spanned by one window
    seg = (spec.frames + nblk) * hop
    # Position in the signal of every sample the row's windows touch; centre padding = n_fft // 2.
    q = frame0[:, None] * hop + jnp.arange(seg, dtype=jnp.int32)[None, :] - n_fft // 2
    sig = signal[audio][:, None]  # [R, 1]
    q = jnp.where(q < 0, -q, q)  # reflect about the first sample
    q = jnp.where(q >= sig, 2 * (sig - 1) - q, q)  # reflect about the last signal sample
    real = (q >= 0) & (q < length[audio][:, None])  # beyond the audio the signal is zero
    src = jnp.clip(q, 0, w - 1)
    samples = jnp.where(real, x[audio[:, None], src], 0.0)  # [R, seg]
    # Framing without a per-sample gather: window t = hops t .. t + nblk - 1, truncated to n_fft.
    blocks = samples.reshape(n_rows, spec.frames + nblk, hop)
    frames = jnp.concatenate([blocks[:, i : i + spec.frames] for i in range(nblk)], axis=-1)
    frames = frames[..., :n_fft]  # [R, T, n_fft], exact float32 samples
    power = power_spectrum(frames, window, precision=spec.precision)  # [R, T, n_fft // 2 + 1]
    # Full fp32 even where TF32 is the default: the filters' low bins span 7 decades.
    mel = jnp.einsum("rtk,kf->rft", power, filters, precision=jax.lax.Precision.HIGHEST)
    log = jnp.log10(jnp.maximum(mel, 1e-10))  # [R, F, T]
    valid = jnp.arange(spec.frames, dtype=jnp.int32)[None, :] < row_frames[:, None]  # [R, T]
    mask = valid[:, None, :]
    if spec.floor_value is None:
        row_max = jnp.max(jnp.where(mask, log, -jnp.inf), axis=(1, 2))  # [R]
        # A waveform's max spans all of its rows (e.g. all 30 s windows of one audio); padding
        # rows (row_audio >= B) belong to no waveform.
        audio_max = jax.ops.segment_max(row_max, row_audio, num_segments=b)  # [B]
        floor = (audio_max[audio] - 8.0)[:, None, None]
    else:
        floor = np.float32(spec.floor_value)
    finite = jnp.all(
        jnp.isfinite(x) | (jnp.arange(w, dtype=jnp.int32)[None, :] >= length[:, None]), axis=1
    )
    return _scaled(log, floor, mask), finite


_log_mel_jit = jax.jit(log_mel_rows, static_argnames=("spec",))


class LogMel(NamedTuple):
    """Result of `log_mel_spectrogram`.

    Attributes:
      features: `[B_pad, F, T]` device float32; rows >= len(num_frames) and frames
        >= num_frames[i] are padding (0.0).
      finite: `[B_pad]` device bool: every real sample of the waveform was finite (read it
        whenever convenient; the call itself never waits for it).
      num_frames: `[B]` host int: valid frames per waveform (`(signal - n_fft % 2) // hop`,
        as `torch.stft(center=True)` less its last frame).
    """

    features: jax.Array
    finite: jax.Array
    num_frames: np.ndarray


@jaxsync.check.entry_point
def log_mel_spectrogram(
    waveforms: Any,
    lengths: Any = None,
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
      placement: device or sharding for the upload of host waveforms (a device input stays
        where it is: its metadata goes next to it, replicated over its mesh).

    Returns:
      `LogMel` with padded device features and host frame counts.

    Raises:
      ValueError: empty or too-short audio, lengths out of range, NaN/inf in host waveforms,
        a sampling-rate mismatch, floor="global" without a configured max, or a device input
        on other devices than `placement`.
      TypeError: non-integer lengths or settings, non-float waveforms.
    """
    token = _settings_token(
        (config, floor, pad_to_multiple_of, max_length, sampling_rate, placement)
    )
    run, key = (None, None) if token is None else _CALLS.find(waveforms, lengths, token)
    if run is not None:
        return run(waveforms)
    floor = resolve_floor(config, floor)
    x, lens = check_waveforms(waveforms, lengths, config, sampling_rate=sampling_rate)
    on_device = isinstance(x, jax.Array)
    b_pad, width = x.shape if on_device else host_buckets(lens, config.hop_length)
    plan = plan_log_mel(
        lens, width, b_pad, config, floor=floor, pad_to_multiple_of=pad_to_multiple_of,
        max_length=max_length,
    )  # fmt: skip
    if on_device:
        if placement is not None:
            check_devices(x, devices_of(placement), "waveforms", other="placement=")
    else:
        x = jaxsync.default_staging.upload(stage_batch(x, lens, (b_pad, width), placement))
    meta = jaxsync.upload_packed(plan, placement=jaxsync.replicated_near(x))
    spec = MelSpec(config, plan.frames, plan.floor_value)
    num_frames = plan.num_frames

    def run(w: jax.Array) -> LogMel:  # a fresh frame-count array per call: the caller's own
        feats, finite = _log_mel_jit(w[None] if w.ndim == 1 else w, meta, spec=spec)
        return LogMel(features=feats, finite=finite, num_frames=num_frames.copy())

    if not on_device or key is None:
        return run(x)
    return _CALLS.keep(key, prepared_call(run, "waveforms"))(waveforms)


# Kept calls on device waveforms, keyed by their signature, `lengths` and the settings' token:
# a repeated call is a lookup and the dispatch.
_CALLS = CallCache(maxsize=64)
_TOKENS: dict[tuple, tuple[int]] = {}  # settings -> (n,): a process sees a handful of them
_COUNT = itertools.count()  # unique tokens across threads
_PLAIN = (type(None), bool, int, str, MelConfig, jax.Device, jax.sharding.Sharding)


def _settings_token(settings: tuple) -> tuple[int] | None:
    """A call key's stand-in for the settings (a tuple of one int), or None for settings of
    types the checks refuse (only plain hashable types are keyed)."""
    if not all(isinstance(s, _PLAIN) for s in settings):
        return None
    token = _TOKENS.get(settings)
    return _TOKENS.setdefault(settings, (next(_COUNT),)) if token is None else token
