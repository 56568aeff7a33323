"""Gemma 3n conformer parts: norms, sub-sample conv projection, feed-forward, light conv."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.models.gemma3n._config import Gemma3nAudioConfig


__all__ = [
    "RMSNorm",
    "CumulativeGroupNorm",
    "SSCPConvBlock",
    "SubSampleConvProjection",
    "ConformerFeedForward",
    "ConformerLightConv1d",
    "clip",
    "linear",
]

# Gemma3nRMSNorm's default eps; upstream uses it (not config.rms_norm_eps) for most conformer norms.
HF_DEFAULT_EPS = 1e-6


def clip(x: jax.Array, bound: float) -> jax.Array:
    """Upstream's "gradient clipping" clamp; identity for realistic activations, kept for parity."""
    # HF clamps the buffer to the dtype's max (matters for fp16/bf16 buffers of 1e10).
    b = min(bound, float(jnp.finfo(x.dtype).max))
    return jnp.clip(x, -b, b)


def linear(din: int, dout: int, cfg_dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din, dout, use_bias=False, dtype=cfg_dtype, param_dtype=param_dtype, rngs=rngs
    )


class RMSNorm(nnx.Module):
    """Gemma 3n RMSNorm: `x * (mean(x²) + eps)^-½ * w` in float32; `w` starts at 1 (not 1+w)."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float = HF_DEFAULT_EPS,
        with_scale: bool = True,
        param_dtype=jnp.float32,
    ):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype)) if with_scale else None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.weight is not None:
            w = self.weight[...].astype(jnp.float32)
            y = y * w.reshape((1,) * (x.ndim - 1) + w.shape)
        return y.astype(x.dtype)


class CumulativeGroupNorm(nnx.Module):
    """Group norm (one group) whose statistics accumulate causally over time.

    Input `[B, T, F, C]`; mean and variance at step t use every feature of steps <= t. Upstream
    passes no mask, so every frame (padding included) counts; the output is never masked either.
    """

    def __init__(self, channels: int, *, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((channels,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)  # [B, T, F, C]
        per_step = xf.shape[2] * xf.shape[3]
        count = per_step * jnp.arange(1, xf.shape[1] + 1, dtype=jnp.float32)
        count = jnp.maximum(count, 1.0)[None, :, None, None]
        mean = jnp.cumsum(jnp.sum(xf, axis=(2, 3), keepdims=True), axis=1) / count
        centred = xf - mean
        # Upstream accumulates squared deviations from each step's *own* cumulative mean.
        var = jnp.cumsum(jnp.sum(centred * centred, axis=(2, 3), keepdims=True), axis=1) / count
        y = centred * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32)[None, None, None, :]
        return y.astype(x.dtype)


class SSCPConvBlock(nnx.Module):
    """Conv2d over (time, freq) with reverse-causal time padding, cumulative group norm, ReLU."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: tuple[int, int],
        stride: tuple[int, int],
        *,
        eps: float,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        # (time top, time bottom), (freq left, freq right): upstream's fixed manual padding.
        self.padding = ((0, kernel[0] - 1), (1, 1))
        self.conv = nnx.Conv(
            cin,
            cout,
            kernel_size=kernel,
            strides=stride,
            padding="VALID",
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.norm = CumulativeGroupNorm(cout, eps=eps, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.pad(x, ((0, 0), *self.padding, (0, 0)))  # [B, T + kt - 1, F + 2, Cin]
        return jax.nn.relu(self.norm(self.conv(x)))  # [B, T', F', Cout]


class SubSampleConvProjection(nnx.Module):
    """Two SSCP conv blocks (4x time reduction at the released config), then a linear to D_a."""

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        f = cfg.input_feat_size
        cin = 1
        blocks = []
        for i in range(2):
            kernel, stride = cfg.sscp_conv_kernel_size[i], cfg.sscp_conv_stride_size[i]
            cout = cfg.sscp_conv_channel_size[i]
            blocks.append(
                SSCPConvBlock(
                    cin,
                    cout,
                    kernel,
                    stride,
                    eps=cfg.sscp_conv_group_norm_eps,
                    rngs=rngs,
                    dtype=dtype,
                    param_dtype=param_dtype,
                )
            )
            f = (f + 2 - kernel[1]) // stride[1] + 1
            cin = cout
        self.conv_0, self.conv_1 = blocks
        self.input_proj_linear = linear(f * cin, cfg.hidden_size, dtype, param_dtype, rngs)

    def __call__(self, features: jax.Array, frames: jax.Array | None = None) -> jax.Array:
        """Args: features `[B, T, F]`; frames: optional int32 scalar, the frame count upstream saw.

        With `frames < T` (the batch was zero padded to a bucket), rows of the first block's output
        past what `frames` input rows give are zeroed: upstream's second block sees zero padding
        there, not the normalised value of padded frames.
        """
        x = self.conv_0(features[..., None])  # [B, T0, F0, C0]
        if frames is not None:
            (kt, _), (st, _) = self.conv_0.conv.kernel_size, self.conv_0.conv.strides
            rows = (frames + kt - 1 - kt) // st + 1
            keep = jnp.arange(x.shape[1])[None, :, None, None] < rows
            x = jnp.where(keep, x, jnp.zeros((), x.dtype))
        x = self.conv_1(x)  # [B, T', F', C]
        b, t, f, c = x.shape
        # Upstream flattens (F', C) with C fastest, i.e. the NHWC layout already in hand.
        return self.input_proj_linear(x.reshape(b, t, f * c))  # [B, T', D]


class ConformerFeedForward(nnx.Module):
    """Macaron feed-forward half: clip, norm, D->4D SiLU 4D->D, clip, norm, scaled residual."""

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        d = cfg.hidden_size
        self.bound = cfg.gradient_clipping
        self.scale = cfg.conf_residual_weight
        self.pre_layer_norm = RMSNorm(d, param_dtype=param_dtype)
        self.ffw_layer_1 = linear(d, 4 * d, dtype, param_dtype, rngs)
        self.ffw_layer_2 = linear(4 * d, d, dtype, param_dtype, rngs)
        self.post_layer_norm = RMSNorm(d, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.pre_layer_norm(clip(x, self.bound))
        h = self.ffw_layer_2(jax.nn.silu(self.ffw_layer_1(h)))
        h = self.post_layer_norm(clip(h, self.bound))
        return x + h * jnp.asarray(self.scale, h.dtype)


class ConformerLightConv1d(nnx.Module):
    """Norm, D->2D GLU, causal depthwise conv over time, clip, norm, SiLU, D->D, residual."""

    def __init__(
        self, cfg: Gemma3nAudioConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        d = cfg.hidden_size
        self.bound = cfg.gradient_clipping
        self.kernel_size = cfg.conf_conv_kernel_size
        self.pre_layer_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.linear_start = linear(d, 2 * d, dtype, param_dtype, rngs)
        self.depthwise_conv1d = nnx.Conv(
            d,
            d,
            kernel_size=(self.kernel_size,),
            padding="VALID",
            feature_group_count=d,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.conv_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.linear_end = linear(d, d, dtype, param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # The loader keeps each channel's value and gate side by side (`GLU_PAIRS`), so a split of
        # the columns over devices holds whole pairs: the GLU needs no exchange.
        pairs = self.linear_start(self.pre_layer_norm(x))  # [B, T, 2D]
        pairs = pairs.reshape(*pairs.shape[:-1], -1, 2)  # [B, T, D, (value, gate)]
        h = pairs[..., 0] * jax.nn.sigmoid(pairs[..., 1])  # [B, T, D]
        h = jnp.pad(h, ((0, 0), (self.kernel_size - 1, 0), (0, 0)))  # causal
        h = clip(self.depthwise_conv1d(h), self.bound)
        h = self.linear_end(jax.nn.silu(self.conv_norm(h)))
        return h + x
