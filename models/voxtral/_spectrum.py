"""Windowed power spectrum of the log-mel front end, in float64 where the backend has it natively.

Why float64: a float32 FFT (and float32 windowing) errs by ~2**-24 of the frame norm in every
bin. Narrow low-frequency mel filters over a spectral null sit up to ~7 decades below that norm
and the dynamic-range floor (max - 8 decades) keeps them, so float32 alone reaches ~1e-5 on CPU
(128 bins) and ~2e-5 with cuFFT on the (log10 + 4) / 4 features, against the issue's bound of 2e-5
vs a float64 oracle. With the windowing, FFT and power in float64 (power then rounded to float32
for the mel matmul) what is left is the float32 log10: ~1.4e-7.

Where: XLA runs float64 FFTs natively on CPU (ducc) and GPUs (cuFFT, hipFFT). TPU has no native
float64 (emulated, slowly, and not for FFTs), so it and any other platform keep the float32 path;
the choice is static per program (`MelSpec.float64`, part of the jit key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


_FLOAT64_PLATFORMS = frozenset({"cpu", "gpu", "cuda", "rocm"})


def spectral_float64(x: jax.Array) -> bool:
    """Static choice of the spectral precision from the platform `x` lives on (no device read).

    A tracer (the entry point traced inside an outer jit, or by `jaxsync.check`'s static scans)
    has no devices yet; that program compiles for the default backend.
    """
    try:
        platforms = {d.platform for d in x.sharding.device_set}
    except AttributeError:
        platforms = {jax.default_backend()}
    return platforms <= _FLOAT64_PLATFORMS


def _float64_scope():
    """Thread-local scope in which explicit float64 dtypes are honoured while tracing.

    `jax.enable_x64` is the public context manager (jax >= 0.8; jax 0.10 removed the experimental
    one; `jax_explicit_x64_dtypes` has no public scoped form). Entered inside the trace around the
    spectral stage only, it is part of no jit key (the caller's program stays keyed on the user's
    setting, so nothing recompiles per call) and is restored on exit, exceptions included; other
    threads and the user's code outside it never see it. Every dtype inside the scope is
    explicit, so what enable_x64 does to default dtypes changes nothing here.
    """
    return jax.enable_x64(True)


def _power(frames: jax.Array, window: jax.Array) -> jax.Array:
    spectrum = jnp.fft.rfft(frames * window[None, None, :], axis=-1)
    return jnp.square(spectrum.real) + jnp.square(spectrum.imag)


def power_spectrum(frames: jax.Array, window: jax.Array, *, float64: bool) -> jax.Array:
    """`|rfft(frames * window)|**2`, float32 out on both paths.

    Args:
      frames: `[R, T, n_fft]` float32 frames (exact audio samples).
      window: `[2, n_fft]` float32 window and its float32 rounding residual (`device_tables`).
      float64: window, FFT and power in float64 (`spectral_float64`), else in float32 (the
        float32 window alone, as vLLM and transformers).

    Returns:
      `[R, T, n_fft // 2 + 1]` float32 power.
    """
    if not float64:
        return _power(frames, window[0])
    with _float64_scope():
        f64 = jnp.float64
        win = window[0].astype(f64) + window[1].astype(f64)  # the float64 window to ~2**-48
        # Rounding the power to float32 costs ~1e-8 on the features (log10 / 4 of a 2**-24
        # relative error), so the mel matmul stays float32 on every path.
        return _power(frames.astype(f64), win).astype(jnp.float32)
