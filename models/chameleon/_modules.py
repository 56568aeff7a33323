# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""The Chameleon VQ-VAE encoder and vector quantizer as NNX modules (NHWC inside).

The blocks mirror `transformers`' `ChameleonVQVAE` (ResnetBlock, AttnBlock, Downsample, conv_in,
norm_out, conv_out, quant_conv, quantize.embedding). The encoder's repeated blocks are stored
stacked by shape kind (`_layout.py`): the checkpoint's per-block keys load into slices of those
stacks. The decoder side (`post_quant_conv`) is not needed to tokenize images and is not built.
`ChameleonImageTower` adds the text model's token embedding, which embeds the image tokens.
"""

from __future__ import annotations

import functools as ft

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype
from jaxtyping import Array, Float, Int

import jaxsync
from jaxsync.models._sharding import OutSharding, place_rows
from jaxsync.models.chameleon._config import GROUP_NORM_GROUPS, ChameleonConfig, ChameleonVQConfig
from jaxsync.models.chameleon._layout import block_rows, encoder_layout
from jaxsync.models.chameleon._vocab import img2bpe


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


def _conv(cin: int, cout: int, k: int, dtype, param_dtype, rngs: nnx.Rngs, **kw) -> nnx.Conv:
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
        self.conv1 = _conv(cin, cout, 3, **kw)
        self.conv2 = _conv(cout, cout, 3, **kw)
        self.nin_shortcut = _conv(cin, cout, 1, **kw) if cin != cout else None
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
        self.q = _conv(channels, channels, 1, **kw)
        self.k = _conv(channels, channels, 1, **kw)
        self.v = _conv(channels, channels, 1, **kw)
        self.proj_out = _conv(channels, channels, 1, **kw)
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
        self.conv = _conv(
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

        self.conv_in = _conv(cfg.in_channels, cfg.base_channels, 3, rngs=rngs, **kw)
        self.res = stacks("res", lambda cin, cout: lambda r: ResnetBlock(cin, cout, rngs=r, **kw))
        self.attn = stacks("attn", lambda c, _: lambda r: AttnBlock(c, rngs=r, **kw))
        self.downsample = stacks("downsample", lambda c, _: lambda r: Downsample(c, rngs=r, **kw))
        width = cfg.level_channels[-1]
        self.norm_out = _norm(width, dtype, param_dtype, rngs)
        self.conv_out = _conv(width, cfg.latent_channels, 3, rngs=rngs, **kw)

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


class ChameleonImageTower(nnx.Module):
    """What turns images into the rows a Chameleon prompt holds: the VQ-VAE tokenizer and the
    text model's token embedding (vLLM embeds the image tokens with `get_input_embeddings`).

    Args:
      cfg: the model config (the VQ config and the text vocabulary and width).
      dtype: computation dtype (the "model dtype"); the rows come out in it.
      param_dtype: parameter dtype.
      rngs: parameter initialisation.

    Attributes:
      cfg: the config.
      vqmodel: the `ChameleonVQVAE` (checkpoint keys `model.vqmodel.*`).
      embed_tokens: the text embedding `[vocab_size, hidden_size]` (`model.embed_tokens.weight`).
    """

    def __init__(
        self,
        cfg: ChameleonConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        if not isinstance(cfg, ChameleonConfig):
            raise TypeError(f"cfg must be a ChameleonConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.dtype = dtype
        self.vqmodel = ChameleonVQVAE(cfg.vq, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )


def check_inputs(cfg: ChameleonConfig, pixels: jax.Array, meta) -> None:
    """Trace-time check that `pixels` and `meta` fit the plan and the tower (static shapes).

    Raises:
      ValueError: naming both sides, instead of a broadcast error deep in the forward.
    """
    image = (cfg.vq.in_channels, cfg.vq.resolution, cfg.vq.resolution)
    rows = meta.valid.shape[0]
    if tuple(pixels.shape) != (rows, *image):
        raise ValueError(
            f"pixels have shape {tuple(pixels.shape)} but the plan pads to {rows} images of "
            f"{image}: pixels must be [{rows}, {', '.join(map(str, image))}]"
        )
    codes = meta.img2bpe.shape[0]
    if codes != cfg.vq.num_embeddings:
        raise ValueError(
            f"the plan's img2bpe table has {codes} entries but the tower's codebook "
            f"{cfg.vq.num_embeddings}: plan with the tower's config"
        )


def forward(
    model: ChameleonImageTower,
    pixels: Float[Array, "Bp C R R"],
    meta,
    *,
    encoder_only=False,
    out_sharding: OutSharding = None,
) -> jaxsync.Encoded:
    """Pixels -> the embedded image tokens of every image, pure (callable in any jit).

    Args:
      model: the tower (weights are traced arguments where the caller jits).
      pixels: `[Bp, C, R, R]` normalised pixels, Bp = `plan.rows` (bucket padded).
      meta: `jaxsync.upload_packed(plan)` of `plan(num_images, cfg)`: `valid` bool [Bp] (True
        for real images) and `img2bpe` int32 [N] (VQ code -> BPE id). Padding images are zeroed
        first, so a server's reused pixel slab with stale or non-finite rows costs nothing.
      encoder_only: rows are the VQ encoder's hidden states (its latents before `quant_conv`,
        `[Bp*T, latent_channels]`) instead of the embedded tokens.
      out_sharding: where the rows go: a `Sharding`, a `PartitionSpec` over the weights' mesh
        (e.g. `P("data")` for images the server splits over "data"), or None: replicated over
        the weights' mesh (unconstrained for weights on one device).

    Returns:
      `jaxsync.Encoded`: rows `[Bp*T, D]` in the model dtype, `embed_tokens` of the image's BPE
      ids, image i at rows `i*T : (i+1)*T` in raster order (vLLM's `get_input_embeddings` of
      the image tokens); finite bool [Bp]: False where an image or its rows held a NaN or inf
      (each image is normalised, convolved and quantised on its own, so the others are
      unaffected), and for padding; extras `{"ids": int32 [Bp*T]}`, the BPE ids of the rows.

    Raises:
      ValueError: at trace time, pixels or a plan that do not fit each other or the tower.
    """
    check_inputs(model.cfg, pixels, meta)
    valid = meta.valid  # [Bp]
    finite = jnp.all(jnp.isfinite(pixels), axis=(1, 2, 3)) & valid
    pixels = jnp.where(valid[:, None, None, None], pixels, jnp.zeros((), pixels.dtype))
    latents, codes = model.vqmodel(pixels)  # [Bp, h, w, L], [Bp, T]
    bp, t = codes.shape
    ids = img2bpe(codes, meta.img2bpe).reshape(bp * t)  # [Bp*T]
    if encoder_only:
        rows = latents.reshape(bp * t, latents.shape[-1])  # [Bp*T, L]
    else:
        rows = model.embed_tokens(ids)  # [Bp*T, D]
    finite &= jnp.all(jnp.isfinite(rows).reshape(bp, -1), axis=1)
    return jaxsync.Encoded(place_rows(model, rows, out_sharding), finite, {"ids": ids})


forward_encoder_only = ft.partial(forward, encoder_only=True)
"""`forward(..., encoder_only=True)`: one function object, so its programs are shared."""
