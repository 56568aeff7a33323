"""The shared attention-implementation choice (cuDNN only for 16-bit towers on GPU)."""

import jax
import jax.numpy as jnp
import pytest

from jaxsync.models._attention import resolve_attention


@pytest.mark.parametrize(
    "backend, dtype, head_dim, want",
    [
        ("cpu", jnp.bfloat16, 64, "xla"),
        ("gpu", jnp.bfloat16, 64, "cudnn"),
        ("gpu", jnp.float16, 128, "cudnn"),
        ("gpu", jnp.float32, 64, "xla"),  # fp32 parity runs keep the exact XLA form
        ("gpu", jnp.bfloat16, 7, "xla"),  # cuDNN needs head_dim % 8 == 0
        ("gpu", jnp.bfloat16, 256, "xla"),
    ],
)
def test_auto(monkeypatch, backend, dtype, head_dim, want):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert resolve_attention("auto", dtype, head_dim) == want


def test_explicit_and_invalid():
    assert resolve_attention("xla", jnp.bfloat16, 64) == "xla"
    assert resolve_attention("cudnn", jnp.float32, 64) == "cudnn"
    with pytest.raises(ValueError, match="attention must be"):
        resolve_attention("flash", jnp.bfloat16, 64)
