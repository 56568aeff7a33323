"""Activations shared by the towers, written for the accelerator's cost model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


_SQRT_HALF = float(np.sqrt(0.5))


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, `x * Phi(x)`, as torch's `F.gelu` computes it: in float32, cast back.

    `jax.nn.gelu(approximate=False)` lowers through `erfc` (an exponential, divisions and two
    polynomial branches) and rounds 1/sqrt(2) to the input dtype; on a GPU its fusion ran
    compute-bound at several times the memory time of the MLP activation it reads. `erf` is
    one clamped rational polynomial, so this form stays at memory speed. The two agree to
    float32 rounding for fp32 inputs.
    """
    xf = x.astype(jnp.float32)
    return (0.5 * xf * (1.0 + jax.lax.erf(xf * _SQRT_HALF))).astype(x.dtype)
