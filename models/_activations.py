"""Activations shared by the towers, written for the accelerator's cost model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

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


def _tanh_gelu(x: jax.Array) -> jax.Array:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): transformers' gelu_new, gelu_fast and
    gelu_pytorch_tanh, which differ only in float rounding."""
    return jax.nn.gelu(x, approximate=True)


def _quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


# transformers' `ACT2FN` names the towers implement; a config naming another is refused.
ActivationName = Literal[
    "gelu",
    "gelu_python",
    "gelu_new",
    "gelu_fast",
    "gelu_pytorch_tanh",
    "quick_gelu",
    "relu",
    "sigmoid",
    "silu",
    "swish",
    "tanh",
]
ACTIVATION_NAMES: tuple[str, ...] = ActivationName.__args__
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu,  # transformers' "gelu" is the exact erf form
    "gelu_python": gelu,
    "gelu_new": _tanh_gelu,
    "gelu_fast": _tanh_gelu,
    "gelu_pytorch_tanh": _tanh_gelu,
    "quick_gelu": _quick_gelu,
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The function of transformers' `ACT2FN[name]` (one object per name).

    Raises:
      ValueError: a name the towers do not implement.
    """
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {ACTIVATION_NAMES})")
    return _ACTIVATIONS[name]
