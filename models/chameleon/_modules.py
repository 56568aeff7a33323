# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""The Chameleon VQ-VAE encoder and vector quantizer as NNX modules (NHWC inside), and `forward`.

The module tree mirrors `transformers`' `ChameleonVQVAE` (encoder.conv_in, encoder.down[i].block[j],
.attn[j], .downsample.conv, encoder.mid.{block_1, attn_1, block_2}, norm_out, conv_out, quant_conv,
quantize.embedding), so the weight rules are one-to-one. The decoder side (`post_quant_conv`) is
not needed to tokenize images and is not built.

`forward(vq_model, pixels, meta)` is the pure tokenizer forward: callable inside a server's own
`jax.jit`, `shard_map` or scan with the weights as arguments (`nnx.merge(graphdef, state)`).
The VQ encoder has no stack of identical layers (levels differ in width), so
`jaxsync.TowerProgram(model, forward, layers=None)` packs its state flat.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxsync.models.chameleon._config import GROUP_NORM_GROUPS, ChameleonVQConfig


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


def _conv(cin: int, cout: int, k: int, dtype, param_dtype, rngs: nnx.Rngs, **kw) -> nnx.Conv:
    pad = (k - 1) // 2
    kw.setdefault("padding", ((pad, pad), (pad, pad)))
    return nnx.Conv(cin, cout, (k, k), dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kw)


class ResnetBlock(nnx.Module):
    """GroupNorm-SiLU-conv twice, with a 1x1 `nin_shortcut` when the width changes."""

    def __init__(self, cin: int, cout: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.norm1 = _norm(cin, dtype, param_dtype, rngs)
        self.conv1 = _conv(cin, cout, 3, dtype, param_dtype, rngs)
        self.norm2 = _norm(cout, dtype, param_dtype, rngs)
        self.conv2 = _conv(cout, cout, 3, dtype, param_dtype, rngs)
        self.nin_shortcut = _conv(cin, cout, 1, dtype, param_dtype, rngs) if cin != cout else None

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H W C2"]:
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))  # dropout: identity at inference
        residual = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return residual + h


class AttnBlock(nnx.Module):
    """Single-head self-attention over the H*W grid, with 1x1 conv projections."""

    def __init__(self, channels: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.norm = _norm(channels, dtype, param_dtype, rngs)
        self.q = _conv(channels, channels, 1, dtype, param_dtype, rngs)
        self.k = _conv(channels, channels, 1, dtype, param_dtype, rngs)
        self.v = _conv(channels, channels, 1, dtype, param_dtype, rngs)
        self.proj_out = _conv(channels, channels, 1, dtype, param_dtype, rngs)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H W C"]:
        b, hh, ww, c = x.shape
        h = self.norm(x)
        q = self.q(h).reshape(b, hh * ww, c)  # [B, S, C]
        k = self.k(h).reshape(b, hh * ww, c)
        v = self.v(h).reshape(b, hh * ww, c)
        scores = jnp.einsum("bqc,bkc->bqk", q, k) * jnp.asarray(c**-0.5, q.dtype)
        # Softmax statistics in fp32, as torch's reduced-precision softmax kernels do.
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bqk,bkc->bqc", probs, v).reshape(b, hh, ww, c)
        return x + self.proj_out(out)


class Downsample(nnx.Module):
    """3x3 stride-2 conv after a (0, 1) zero pad on H and W (torch pads bottom/right only)."""

    def __init__(self, channels: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.conv = _conv(
            channels, channels, 3, dtype, param_dtype, rngs, strides=2, padding=((0, 1), (0, 1))
        )

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H2 W2 C"]:
        return self.conv(x)


class Level(nnx.Module):
    """One encoder level: residual blocks, optional attention after each, optional downsample."""

    def __init__(self, cin, cout, *, n_blocks, attn, downsample, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.block = nnx.List(
            [ResnetBlock(cin if i == 0 else cout, cout, **kw) for i in range(n_blocks)]
        )
        self.attn = nnx.List([AttnBlock(cout, **kw) for _ in range(n_blocks)] if attn else [])
        self.downsample = Downsample(cout, **kw) if downsample else None

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H2 W2 C2"]:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        return x if self.downsample is None else self.downsample(x)


class Mid(nnx.Module):
    """Residual block, attention (an identity without `attention`), residual block at the
    lowest resolution."""

    def __init__(self, channels: int, *, attention: bool, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.block_1 = ResnetBlock(channels, channels, **kw)
        self.attn_1 = AttnBlock(channels, **kw) if attention else None
        self.block_2 = ResnetBlock(channels, channels, **kw)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B H W C"]:
        x = self.block_1(x)
        return self.block_2(x if self.attn_1 is None else self.attn_1(x))


class Encoder(nnx.Module):
    """Pixels (NHWC) -> latents `[B, h, w, latent_channels]`."""

    def __init__(self, cfg: ChameleonVQConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.conv_in = _conv(cfg.in_channels, cfg.base_channels, 3, **kw)
        levels, cin = [], cfg.base_channels
        for i, (cout, res) in enumerate(
            zip(cfg.level_channels, cfg.level_resolutions, strict=True)
        ):
            levels.append(
                Level(
                    cin,
                    cout,
                    n_blocks=cfg.num_res_blocks,
                    attn=cfg.attention and res in cfg.attn_resolutions,
                    downsample=i != cfg.num_levels - 1,
                    **kw,
                )
            )
            cin = cout
        self.down = nnx.List(levels)
        self.mid = Mid(cin, attention=cfg.attention, **kw)
        self.norm_out = _norm(cin, dtype, param_dtype, rngs)
        self.conv_out = _conv(cin, cfg.latent_channels, 3, **kw)

    def __call__(self, x: Float[Array, "B H W C"]) -> Float[Array, "B h w L"]:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        x = self.mid(x)
        return self.conv_out(jax.nn.silu(self.norm_out(x)))


class VectorQuantizer(nnx.Module):
    """Nearest codebook entry by `|z|^2 + |e|^2 - 2 z.e`, computed in the model dtype."""

    def __init__(self, cfg: ChameleonVQConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        init = jax.nn.initializers.normal(1.0)
        self.embedding = nnx.Param(
            init(rngs.params(), (cfg.num_embeddings, cfg.embed_dim), param_dtype)
        )

    def __call__(self, z: Float[Array, "M E"]) -> Int[Array, " M"]:
        dt = self.dtype or z.dtype
        z = z.astype(dt)
        e = self.embedding[...].astype(dt)  # [N, E]
        # Each partial result is rounded to the model dtype like torch's bf16 ops (fp32
        # accumulation, one rounding per op), because argmin near-ties depend on that rounding.
        z2 = jnp.sum(z * z, axis=1, keepdims=True, dtype=jnp.float32).astype(dt)  # [M, 1]
        e2 = jnp.sum(e * e, axis=1, dtype=jnp.float32).astype(dt)  # [N]
        ze = jnp.einsum("me,ne->mn", z, e, preferred_element_type=jnp.float32).astype(dt)
        dist = (z2 + e2[None, :]) - jnp.asarray(2, dt) * ze  # [M, N]
        return jnp.argmin(dist, axis=1).astype(jnp.int32)


class ChameleonVQVAE(nnx.Module):
    """The image tokenizer half of Chameleon's VQ-VAE: encoder, `quant_conv`, quantizer.

    Args:
      cfg: the VQ config.
      dtype: computation dtype (the "model dtype"; pixels and distances use it).
      param_dtype: parameter dtype.
      rngs: parameter initialisation.
    """

    def __init__(
        self,
        cfg: ChameleonVQConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        self.cfg = cfg
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.encoder = Encoder(cfg, **kw)
        self.quant_conv = _conv(cfg.latent_channels, cfg.embed_dim, 1, **kw)
        self.quantize = VectorQuantizer(cfg, **kw)

    def __call__(
        self, pixel_values: Float[Array, "B C H W"]
    ) -> tuple[Float[Array, "B h w L"], Int[Array, "B T"]]:
        """Returns the encoder latents (before `quant_conv`, NHWC) and the raster-order VQ codes."""
        x = jnp.transpose(pixel_values.astype(self.dtype), (0, 2, 3, 1))  # [B, H, W, C]
        latents = self.encoder(x)
        z = self.quant_conv(latents)  # [B, h, w, E]
        b, h, w, e = z.shape
        codes = self.quantize(z.reshape(b * h * w, e)).reshape(b, h * w)
        return latents, codes


def forward(
    vq_model: ChameleonVQVAE, pixels: Float[Array, "Bp C R R"], meta
) -> tuple[Int[Array, "Bp T"], Bool[Array, " Bp"]]:
    """Pixels -> raster-order VQ codes and a per-image finite flag, pure.

    Args:
      vq_model: the VQ model (weights are traced arguments where the caller jits).
      pixels: `[Bp, C, R, R]` normalised pixels, bucket padded.
      meta: `plan_images(...).fields` uploaded (`jaxsync.upload_packed`), or the dict itself:
        `valid` bool `[Bp]`, True for real images. Padding rows are zeroed first, so a
        server's reused pixel slab with stale or non-finite rows costs nothing numerically.

    Returns:
      codes int32 `[Bp, T]` (map them with `img2bpe`) and `finite` bool `[Bp]`: False where an
      image held a NaN or inf (its codes are then meaningless; every other row is unaffected,
      since each image is normalised, convolved and quantised on its own).
    """
    valid = meta["valid"]  # [Bp]
    finite = jnp.all(jnp.isfinite(pixels), axis=(1, 2, 3)) & valid
    pixels = jnp.where(valid[:, None, None, None], pixels, jnp.zeros((), pixels.dtype))
    _, codes = vq_model(pixels)
    return codes, finite
