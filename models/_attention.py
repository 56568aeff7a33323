"""Choosing the attention implementation, shared by the model families."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp


AttentionImpl = Literal["auto", "xla", "cudnn"]


def resolve_attention(impl: AttentionImpl, dtype: jnp.dtype, head_dim: int) -> str:
    """ "auto" picks cuDNN flash attention on GPU for 16-bit towers, else XLA's dense softmax.

    cuDNN never writes the [N, Q, K] scores to memory (several times faster than the XLA form on
    a GPU at thousands of patches); fp32 parity runs keep the XLA form.
    """
    if impl not in ("auto", "xla", "cudnn"):
        raise ValueError(f"attention must be 'auto', 'xla' or 'cudnn', got {impl!r}")
    if impl != "auto":
        return impl
    gpu = jax.default_backend() in ("gpu", "cuda")
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if gpu and half and head_dim % 8 == 0 and head_dim <= 128 else "xla"
