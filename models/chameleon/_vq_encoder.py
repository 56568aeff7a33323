# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""The Chameleon VQ-VAE encoder's blocks as NNX modules (NHWC inside).

The blocks mirror `transformers`' `ChameleonVQVAEEncoder` (ResnetBlock, AttnBlock, Downsample,
conv_in, norm_out, conv_out). Its repeated blocks are stored stacked by shape kind
(`_layout.py`): the checkpoint's per-block keys load into slices of those stacks, and a block's
GroupNorm weights and conv biases are rows of one parameter per width (`_layout.block_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype
from jaxtyping import Array, Float

import jaxsync
from jaxsync.models.chameleon._config import GROUP_NORM_GROUPS, ChameleonVQConfig
from jaxsync.models.chameleon._layout import block_rows, encoder_layout


_EPS = 1e-6


def _norm(channels: int, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.GroupNorm:
    # Two-pass variance, as torch's GroupNorm: the one-pass E[x^2]-E[x]^2 loses fp32 digits.
    return nnx.GroupNorm(
        channels,
        num_groups=GROUP_NORM_GROUPS,
        epsilon=_EPS,
        use_fast_variance=False,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def group_norm(
    x: Float[Array, "B H W C"], scale: Float[Array, " C"], bias: Float[Array, " C"], dtype
) -> Float[Array, "B H W C"]:
    """`_norm(C, dtype, ...)` (an `nnx.GroupNorm`) with its scale and bias given: the same
    operations in the same order and dtypes, for a block whose norm weights are rows of one
    parameter. Statistics in at least fp32, two-pass variance (as torch)."""
    x, scale, bias = promote_dtype((x, scale, bias), dtype=dtype)
    b, hh, ww, c = x.shape
    size = c // GROUP_NORM_GROUPS
    stats = jnp.asarray(
        x.reshape(b, hh, ww, GROUP_NORM_GROUPS, size), jnp.promote_types(x.dtype, jnp.float32)
    )
    mean = stats.mean((1, 2, 4))  # [B, G]
    var = jax.lax.square(stats - jnp.expand_dims(mean, (1, 2, 4))).mean((1, 2, 4))
    mean = jnp.repeat(mean, size, axis=1).reshape(b, 1, 1, c)
    var = jnp.repeat(var, size, axis=1).reshape(b, 1, 1, c)
    mul = jax.lax.rsqrt(var + _EPS) * scale.reshape(1, 1, 1, c)
    y = (x - mean) * mul + bias.reshape(1, 1, 1, c)
    return jnp.asarray(y, x.dtype)


def conv(cin: int, cout: int, k: int, dtype, param_dtype, rngs: nnx.Rngs, **kw) -> nnx.Conv:
    """A `k`x`k` `nnx.Conv`, zero padded `(k - 1) // 2` on each side unless `padding` is given."""
    pad = (k - 1) // 2
    kw.setdefault("padding", ((pad, pad), (pad, pad)))
    return nnx.Conv(cin, cout, (k, k), dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kw)


class _Rows(nnx.Module):
    """A block whose GroupNorm weights and conv biases are rows of few parameters, one per
    width (`_layout.block_rows`); its convs hold their kernels only."""

    def _init_rows(self, kind: tuple[str, int, int], widths: dict[str, int], param_dtype):
        self.kind = kind  # (group, cin, cout): the block's rows are `block_rows(*kind)`
        rows = block_rows(*kind)
        for param, width in widths.items():
            names = sorted((i, n) for n, (p, i) in rows.items() if p == param)
            # torch's initialisation: norm weights 1, norm and conv biases 0
            init = [
                1.0 if n.startswith("norm") and n.endswith(".weight") else 0.0 for _, n in names
            ]
            value = jnp.broadcast_to(jnp.asarray(init, param_dtype)[:, None], (len(init), width))
            setattr(self, param, nnx.Param(value))

    def _row(self, name: str) -> jax.Array:
        param, i = block_rows(*self.kind)[name]
        return getattr(self, param)[i]

    def _conv_biased(self, conv: nnx.Conv, name: str, x: jax.Array) -> jax.Array:
        """`conv(x)` plus its bias row, as `nnx.Conv` with its own bias adds it."""
        y = conv(x)
        (bias,) = promote_dtype((self._row(name),), dtype=conv.dtype or y.dtype)
        return y + bias.reshape(1, 1, 1, -1)

    def _normed(self, name: str, x: jax.Array) -> jax.Array:
        return group_norm(x, self._row(f"{name}.weight"), self._row(f"{name}.bias"), self.dtype)


class ResnetBlock(_Rows):
    """GroupNorm-SiLU-conv twice, with a 1x1 `nin_shortcut` when the width changes.

    Its norm weights and conv biases are the rows of `vectors` (and `vectors_in`, norm1's, when
    the block widens): `_layout.block_rows`."""

    def __init__(self, cin: int, cout: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, use_bias=False)
        self.conv1 = conv(cin, cout, 3, **kw)
        self.conv2 = conv(cout, cout, 3, **kw)
        self.nin_shortcut = conv(cin, cout, 1, **kw) if cin != cout else None
        widths = {"vectors": cout} if cin == cout else {"vectors_in": cin, "vectors": cout}
        self._init_rows(("res", cin, cout), widths, param_dtype)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H W C2"]:
        h = self._conv_biased(self.conv1, "conv1.bias", jax.nn.silu(self._normed("norm1", x)))
        h = jax.nn.silu(self._normed("norm2", h))  # dropout: identity at inference
        h = self._conv_biased(self.conv2, "conv2.bias", h)
        if self.nin_shortcut is None:
            return x + h
        return self._conv_biased(self.nin_shortcut, "nin_shortcut.bias", x) + h


class AttnBlock(_Rows):
    """Single-head self-attention over the H*W grid, with 1x1 conv projections.

    Its norm weights and projection biases are the rows of `vectors` `[6, C]`."""

    def __init__(self, channels: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, use_bias=False)
        self.q = conv(channels, channels, 1, **kw)
        self.k = conv(channels, channels, 1, **kw)
        self.v = conv(channels, channels, 1, **kw)
        self.proj_out = conv(channels, channels, 1, **kw)
        self._init_rows(("attn", channels, channels), {"vectors": channels}, param_dtype)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H W C"]:
        b, hh, ww, c = x.shape
        h = self._normed("norm", x)
        q = self._conv_biased(self.q, "q.bias", h).reshape(b, hh * ww, c)  # [B, S, C]
        k = self._conv_biased(self.k, "k.bias", h).reshape(b, hh * ww, c)
        v = self._conv_biased(self.v, "v.bias", h).reshape(b, hh * ww, c)
        scores = jnp.einsum("bqc,bkc->bqk", q, k) * jnp.asarray(c**-0.5, q.dtype)
        # Softmax statistics in fp32, as torch's reduced-precision softmax kernels do.
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bqk,bkc->bqc", probs, v).reshape(b, hh, ww, c)
        return x + self._conv_biased(self.proj_out, "proj_out.bias", out)


class Downsample(nnx.Module):
    """3x3 stride-2 conv after a (0, 1) zero pad on H and W (torch pads bottom/right only)."""

    def __init__(self, channels: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.conv = conv(
            channels, channels, 3, dtype, param_dtype, rngs, strides=2, padding=((0, 1), (0, 1))
        )

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H2 W2 C"]:
        return self.conv(x)


class Encoder(nnx.Module):
    """Pixels (NHWC) -> latents `[B, h, w, latent_channels]`.

    Attributes:
      res, attn, downsample: `nnx.Dict`s of `jaxsync.LayerStack`s by width key (`_layout.py`).
    """

    def __init__(self, cfg: ChameleonVQConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        layout = encoder_layout(cfg)

        def stacks(group: str, make) -> nnx.Dict:  # make(cin, cout) -> (rngs -> one layer)
            return nnx.Dict(
                {
                    key: jaxsync.LayerStack(make(cin, cout), n, rngs=rngs)
                    for key, (n, cin, cout) in layout.stacks[group].items()
                }
            )

        self.conv_in = conv(cfg.in_channels, cfg.base_channels, 3, rngs=rngs, **kw)
        self.res = stacks("res", lambda cin, cout: lambda r: ResnetBlock(cin, cout, rngs=r, **kw))
        self.attn = stacks("attn", lambda c, _: lambda r: AttnBlock(c, rngs=r, **kw))
        self.downsample = stacks("downsample", lambda c, _: lambda r: Downsample(c, rngs=r, **kw))
        width = cfg.level_channels[-1]
        self.norm_out = _norm(width, dtype, param_dtype, rngs)
        self.conv_out = conv(width, cfg.latent_channels, 3, rngs=rngs, **kw)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B h w L"]:
        layout = encoder_layout(self.cfg)
        x = self.conv_in(x)
        for group, key, start, stop in layout.runs:
            stack = getattr(self, group)[key]
            _, cin, cout = layout.stacks[group][key]
            if group == "downsample" or cin != cout:
                # A scan's carry keeps its shape: a block that changes it (a downsample, a
                # level's widening first block) runs alone, on its slice of the stack.
                x = stack.at(start)(x)
            else:
                x = stack(x, span=None if (start, stop) == (0, len(stack)) else (start, stop))
        return self.conv_out(jax.nn.silu(self.norm_out(x)))
