# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""The Chameleon VQ-VAE tokenizer and image tower as NNX modules, and their pure forward.

The modules mirror `transformers`' `ChameleonVQVAE` (encoder, quant_conv, quantize.embedding);
the encoder's blocks are in `_vq_encoder.py`. The decoder side (`post_quant_conv`) is not needed
to tokenize images and is not built. `ChameleonImageTower` adds the text model's token embedding,
which embeds the image tokens. `forward` runs pixels -> VQ codes -> BPE image-token ids -> their
embedding rows in one program: the ids are gathered through a device copy of `img2bpe`
(upstream reads the codes back to the CPU for the lookup), so nothing is read back.
"""

from __future__ import annotations

import functools as ft

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

import jaxsync
from jaxsync._out_sharding import OutSharding, place_rows
from jaxsync.models.chameleon._config import ChameleonConfig, ChameleonVQConfig
from jaxsync.models.chameleon._vocab import img2bpe
from jaxsync.models.chameleon._vq_encoder import Encoder, conv


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
        self.quant_conv = conv(cfg.latent_channels, cfg.embed_dim, 1, **kw)
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


@ft.partial(jax.jit, static_argnums=(1, 2))
def token_rows(ids: jax.Array, n: int, t: int) -> jax.Array:  # [Bp*T] -> [n, T]
    """The first `n` images' ids as rows of `t` (what `get_image_tokens` returns)."""
    return ids[: n * t].reshape(n, t)


def vq_outputs(model: ChameleonImageTower, pixels: jax.Array):  # [B, h, w, L], [B, T]
    """The VQ model's own outputs, unbucketed: encoder latents and codes (for parity)."""
    return model.vqmodel(pixels)
