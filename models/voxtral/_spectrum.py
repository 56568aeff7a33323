"""Windowed power spectrum of the log-mel front end: float64 on CPU and GPU, float32 elsewhere.

Why float64: a float32 FFT (and float32 windowing) errs by ~2**-24 of the frame norm in every
bin. Narrow low-frequency mel filters over a spectral null sit up to ~7 decades below that norm
and the dynamic-range floor (max - 8 decades) keeps them, so float32 alone reaches ~1e-5 on CPU
(128 bins) and ~2e-5 with cuFFT on the (log10 + 4) / 4 features. With the windowing, FFT and power
in float64 (power then rounded to float32 for the mel matmul) what is left is the float32 log10:
~1.4e-7.

Where: XLA runs float64 FFTs natively on CPU (ducc) and GPUs (cuFFT, hipFFT). TPU has no native
float64 (emulated, slowly, and not for FFTs). The choice is made by `jax.lax.platform_dependent`
at lowering, not by the host that traces: a program exported for TPU from a CPU host carries the
float32 spectrum only (no float64 op reaches its StableHLO).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _float64_scope():
    """Thread-local scope in which explicit float64 dtypes are honoured while tracing.

    `jax.enable_x64` is the public context manager. Entered inside the trace around the spectral
    stage only, it is part of no jit key (the caller's program stays keyed on the user's setting,
    so nothing recompiles per call) and is restored on exit, exceptions included; other threads
    and the user's code outside it never see it. Every dtype inside the scope is explicit.
    """
    return jax.enable_x64(True)


def _power(frames: jax.Array, window: jax.Array) -> jax.Array:
    spectrum = jnp.fft.rfft(frames * window[None, None, :], axis=-1)
    return jnp.square(spectrum.real) + jnp.square(spectrum.imag)


def _power_float32(frames: jax.Array, window: np.ndarray) -> jax.Array:
    # The float32 window, as vLLM and transformers multiply by.
    return _power(frames, jnp.asarray(window.astype(np.float32)))


def _power_float64(frames: jax.Array, window: np.ndarray) -> jax.Array:
    with _float64_scope():
        # Rounding the power to float32 costs ~1e-8 on the features (log10 / 4 of a 2**-24
        # relative error), so the mel matmul stays float32 on every path.
        win = jnp.asarray(window, jnp.float64)
        return _power(frames.astype(jnp.float64), win).astype(jnp.float32)


def power_spectrum(frames: jax.Array, window: np.ndarray, *, precision: str | None = None):
    """`|rfft(frames * window)|**2`, float32 out.

    Args:
      frames: `[R, T, n_fft]` float32 frames (exact audio samples).
      window: `[n_fft]` float64 NumPy window (a constant of the program).
      precision: None picks per platform at lowering (float64 on CPU / CUDA / ROCm, float32 on
        TPU and anything else); "float32" / "float64" force one path (tests, tolerance studies).

    Returns:
      `[R, T, n_fft // 2 + 1]` float32 power.
    """
    if precision == "float32":
        return _power_float32(frames, window)
    if precision == "float64":
        return _power_float64(frames, window)
    if precision is not None:
        raise ValueError(f"precision must be None, 'float32' or 'float64', got {precision!r}")
    f64 = lambda f: _power_float64(f, window)  # noqa: E731
    return jax.lax.platform_dependent(
        frames, cpu=f64, cuda=f64, rocm=f64, default=lambda f: _power_float32(f, window)
    )
