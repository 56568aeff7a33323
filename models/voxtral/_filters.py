"""Constant tables of the log-mel front end: the Slaney mel filter bank and the Hann window.

Pure functions of the config, computed once with NumPy in float64 and closed over by the traced
front end as constants (so they follow whatever placement the inputs have). The filters are cast
to float32 where they are used, as vLLM and transformers do before the matmul.
"""

from __future__ import annotations

import functools as ft

import numpy as np

from jaxsync.models.voxtral._config import MelConfig


_MIN_LOG_HZ = 1000.0  # Slaney: linear below 1 kHz (3 mels per 200 Hz), logarithmic above
_MIN_LOG_MEL = 15.0
_MELS_PER_LOG = 27.0 / np.log(6.4)  # 27 mels per factor 6.4 above 1 kHz
_LOG_PER_MEL = np.log(6.4) / 27.0


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, np.float64)
    log = _MIN_LOG_MEL + np.log(np.maximum(f, _MIN_LOG_HZ) / _MIN_LOG_HZ) * _MELS_PER_LOG
    return np.where(f >= _MIN_LOG_HZ, log, 3.0 * f / 200.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, np.float64)
    log = _MIN_LOG_HZ * np.exp(_LOG_PER_MEL * (np.maximum(m, _MIN_LOG_MEL) - _MIN_LOG_MEL))
    return np.where(m >= _MIN_LOG_MEL, log, 200.0 * m / 3.0)


@ft.cache
def slaney_mel_filters(cfg: MelConfig) -> np.ndarray:
    """Slaney-scale, area-normalised triangular filters, float64 `[n_fft // 2 + 1, F]`.

    Raises:
      ValueError: if a filter is all zero (too many mel bins for the FFT size), as mistral-common
        does (transformers only warns).
    """
    n_freq = cfg.n_fft // 2 + 1
    edges_mel = np.linspace(
        _hz_to_mel(cfg.min_frequency), _hz_to_mel(cfg.max_frequency), cfg.num_mel_bins + 2
    )
    edges = _mel_to_hz(edges_mel)  # [F + 2] Hz
    fft_hz = np.linspace(0.0, cfg.sampling_rate // 2, n_freq)  # [n_freq]
    width = np.diff(edges)  # [F + 1]
    rel = edges[None, :] - fft_hz[:, None]  # [n_freq, F + 2]
    rising = -rel[:, :-2] / width[None, :-1]
    falling = rel[:, 2:] / width[None, 1:]
    tri = np.maximum(0.0, np.minimum(rising, falling))  # [n_freq, F]
    tri = tri * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    if (tri.max(axis=0) == 0.0).any():
        empty = np.flatnonzero(tri.max(axis=0) == 0.0).tolist()
        raise ValueError(
            f"mel filters {empty} are all zero: num_mel_bins={cfg.num_mel_bins} is too many for "
            f"n_fft={cfg.n_fft} at {cfg.sampling_rate} Hz"
        )
    tri.setflags(write=False)
    return tri


@ft.cache
def periodic_hann(n: int) -> np.ndarray:
    """`torch.hann_window(n)` (periodic): `0.5 - 0.5 cos(2 pi k / n)`, float64 `[n]`."""
    w = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)
    w.setflags(write=False)
    return w
