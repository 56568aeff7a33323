# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""`get_image_tokens`: pixels -> VQ codes -> BPE ids in one jitted program, batch bucketed.

vLLM post-PR gathers through a cached device copy of the `img2bpe` table; pre-PR (and HF) read
the codes back to the CPU for the lookup. Here the encoder, the argmin and the gather are one XLA
program per batch bucket, the table comes from a `DeviceCache`, and nothing is read back.
"""

from __future__ import annotations

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

import jaxsync
import jaxsync.check
from jaxsync.models.chameleon._vocab import ImageVocabularyMapping
from jaxsync.models.chameleon._vqvae import ChameleonVQVAE


_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))


@ft.partial(jax.jit, static_argnums=1)
def _take_rows(x: jax.Array, n: int) -> jax.Array:
    return x[:n]


@ft.partial(jax.jit, static_argnums=1)
def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


class ChameleonImageTokenizer:
    """Images -> `(B, T)` int32 BPE ids (T = 1024 for the released model), sync-free.

    Args:
      vqvae: the loaded VQ-VAE (see `load_vqvae`).
      mapping: the image vocabulary (its `img2bpe` must cover the codebook).
      buckets: batch buckets (ascending); default powers of two from 1.
      placement: device or sharding for the pixels and the table; None = default device.

    Compilation: the encoder program is compiled once per bucket. The first call that lands in a
    bucket also compiles the tiny row slice (and, for device-array inputs, row pad) for every
    batch size of that bucket, so later calls with any batch size of the bucket compile nothing.
    """

    def __init__(
        self,
        vqvae: ChameleonVQVAE,
        mapping: ImageVocabularyMapping,
        *,
        buckets: tuple[int, ...] | None = None,
        placement: jax.Device | jax.sharding.Sharding | None = None,
    ):
        cfg = vqvae.cfg
        if mapping.num_codes < cfg.num_embeddings:
            raise ValueError(
                f"img2bpe covers {mapping.num_codes} codes but the codebook has "
                f"{cfg.num_embeddings}"
            )
        self.cfg = cfg
        self.mapping = mapping
        self.buckets = buckets
        self.placement = placement
        self.image_shape = (cfg.in_channels, cfg.resolution, cfg.resolution)
        # A flat array list, not an nnx.State (65 Variables walked in Python per call otherwise).
        self._state, module = jaxsync.flat_state(*nnx.split(vqvae))

        def run(leaves, table, pixels):  # [Bp, C, H, W] -> [Bp, T]
            _, codes = module(leaves)(pixels)
            return table[codes]

        self._run = jax.jit(run)
        self._encode = jax.jit(lambda leaves, pixels: module(leaves)(pixels))
        self._warm: set[tuple] = set()

    def _bucket(self, n: int) -> int:
        return jaxsync.bucket(n, self.buckets, minimum=1)

    def _validate(self, pixel_values) -> int:
        shape = tuple(pixel_values.shape)
        if len(shape) != 4 or shape[1:] != self.image_shape:
            raise ValueError(
                f"pixel_values must have shape (B, {', '.join(map(str, self.image_shape))}), "
                f"got {shape}"
            )
        if np.dtype(pixel_values.dtype) not in _FLOATS:
            raise ValueError(
                f"pixel_values must be float32/float16/bfloat16, got {pixel_values.dtype}"
            )
        if shape[0] < 1:
            raise ValueError("pixel_values holds no image")
        return shape[0]

    @jaxsync.check.entry_point
    def get_image_tokens(self, pixel_values: np.ndarray | jax.Array) -> Int[Array, "B T"]:
        """BPE ids of each image's tokens in raster order.

        Args:
          pixel_values: `[B, C, R, R]` normalised pixels, host (numpy: padded on the host and
            uploaded once) or device (`jax.Array`: padded on the device).

        Returns:
          int32 `[B, T]`, `T = (R / 2**(levels-1))**2`.

        Raises:
          ValueError: wrong rank, image size, channel count or dtype (checked before dispatch).
        """
        n = self._validate(pixel_values)
        padded = self.get_image_tokens_padded(pixel_values)
        return padded if padded.shape[0] == n else _take_rows(padded, n)

    @jaxsync.check.entry_point
    def get_image_tokens_padded(self, pixel_values: np.ndarray | jax.Array) -> Int[Array, "Bp T"]:
        """Like `get_image_tokens` but returns the whole bucket `[bucket(B), T]`.

        Rows `B..` are the tokens of all-zero padding images; consumers that carry the image
        count on the host (e.g. `merge_image_embeddings`) can use this directly.
        """
        n = self._validate(pixel_values)
        rows = self._bucket(n)
        table = self.mapping.img2bpe_on(self.placement)
        if isinstance(pixel_values, jax.Array):
            pixels = pixel_values if n == rows else _pad_rows(pixel_values, rows)
        else:
            staging = np.zeros((rows, *self.image_shape), dtype=pixel_values.dtype)
            staging[:n] = pixel_values
            # `staging` is this call's own buffer: no second host copy of the pixels.
            pixels = jaxsync.async_h2d(staging, placement=self.placement, copy=False)
        out = self._run(self._state, table, pixels)
        self._warm_bucket(rows, out, pixel_values)
        return out

    def encode(self, pixel_values: jax.Array) -> tuple[Float[Array, "B h w L"], Int[Array, "B T"]]:
        """Encoder latents (NHWC, before `quant_conv`) and VQ codes, unbucketed (for parity)."""
        self._validate(pixel_values)
        return self._encode(self._state, pixel_values)

    def _warm_bucket(self, rows: int, out: jax.Array, pixel_values) -> None:
        # Compile the per-batch-size slice / pad programs of this bucket once, on its first use,
        # by dispatching them on arrays of the exact shardings later calls will pass.
        if isinstance(out, jax.core.Tracer):  # traced by a static scan: nothing runs
            return
        on_device = isinstance(pixel_values, jax.Array)
        key = (rows, on_device, str(pixel_values.dtype), on_device and pixel_values.committed)
        if key in self._warm:
            return
        self._warm.add(key)
        lo = self._bucket_floor(rows)
        for n in range(lo, rows):
            _take_rows(out, n)
            if isinstance(pixel_values, jax.Array):
                shape = (n, *self.image_shape)
                # Match the input's committedness too: it is part of jit's cache key.
                where = pixel_values.sharding if pixel_values.committed else None
                dummy = jax.device_put(np.zeros(shape, pixel_values.dtype), where)
                _pad_rows(dummy, rows)

    def _bucket_floor(self, rows: int) -> int:
        """The smallest batch size that lands in bucket `rows`."""
        lo = rows
        while lo > 1 and self._bucket(lo - 1) == rows:
            lo -= 1
        return lo
