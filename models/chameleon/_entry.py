# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""`ChameleonImageEncoder`: Chameleon's image tower (and its text-side paths) behind one host
object, one dispatch of `jaxsync.TowerProgram(model, forward)` per call."""

from __future__ import annotations

import functools as ft
from operator import attrgetter

import jax
from jaxtyping import Array, Float, Int

import jaxsync
import jaxsync.check
from jaxsync._batching import BucketEntry, Warmer
from jaxsync._encoder import TowerEncoder, expect, weight_devices
from jaxsync._entry import Planned, on_devices
from jaxsync._out_sharding import OutSharding
from jaxsync.models.chameleon import _modules
from jaxsync.models.chameleon._inputs import PIXELS, check_pixels, host_pixels, pixel_checks
from jaxsync.models.chameleon._modules import ChameleonImageTower, token_rows
from jaxsync.models.chameleon._plan import ChameleonPlan, bucket_batch_sizes, images_planner, plan
from jaxsync.models.chameleon._text import ChameleonTextPaths
from jaxsync.models.chameleon._vocab import check_device_array
from jaxsync.models.chameleon._weights import load_model


class ChameleonImageEncoder(ChameleonTextPaths, TowerEncoder):
    """Image tower of one Chameleon model, and the text-side paths of `ChameleonTextPaths`
    (logit mask, masked logits, merge); see `TowerEncoder`.

    Args:
      model: the tower (`load_model`, or `ChameleonImageTower(cfg, rngs=...)`).
      encoder_only: the rows are the VQ encoder's latents (`[T, latent_channels]` per image,
        before `quant_conv`) instead of the embedded image tokens.
      buckets: image-count buckets (default `IMAGE_BUCKETS`: 1, 4, 8, ...).
      missing_code_id: see `ImageVocabularyMapping` (None: a code without a name is an error).
      cache: the `DeviceCache` for the text-side tables (default: the process-wide one).
      placement, out_sharding: as `TowerEncoder`'s; pixels may be split over a mesh's data
        axis (dimension 0) alone, and the batch is then padded to a multiple of it.

    A bucket's first call also compiles the row slices (and device pixels' pads) of every batch
    size in it, so later calls compile nothing.
    """

    load_model = staticmethod(load_model)

    def __init__(
        self,
        model: ChameleonImageTower,
        *,
        encoder_only: bool = False,
        buckets: tuple[int, ...] | None = None,
        placement: jax.Device | jax.sharding.Sharding | None = None,
        missing_code_id: int | None = None,
        cache: jaxsync.DeviceCache | None = None,
        out_sharding: OutSharding = None,
    ):
        expect(model, ChameleonImageTower, " (load_model)")
        ChameleonTextPaths.__init__(self, model.cfg, missing_code_id=missing_code_id, cache=cache)
        self.mapping.check_code_table()  # the tokenizer needs every code named
        self.missing_code_id, self.buckets = missing_code_id, buckets
        self.encoder_only = bool(encoder_only)
        vq = self.cfg.vq
        self.image_shape = (vq.in_channels, vq.resolution, vq.resolution)
        self.tokens_per_image = t = vq.tokens_per_image
        # One entry per output form over one plan cache and one batch split.
        sizes = lambda rows, where: bucket_batch_sizes(rows, buckets, self._split.shards(where))  # noqa: E731
        warm = Warmer(sizes, lambda out, n: token_rows(out.extras["ids"], n, t))
        kind = ft.partial(BucketEntry, batch=attrgetter("rows"), warm=warm, to_host=host_pixels)
        forward = _modules.forward_encoder_only if self.encoder_only else _modules.forward
        placed = on_devices(weight_devices(model), PIXELS, uncommitted_moves=True)
        TowerEncoder.__init__(self, model, forward, name=PIXELS,
                              checks=(*pixel_checks(self.image_shape), placed),
                              placement=placement, out_sharding=out_sharding, entry=kind,
                              plan_of=lambda: self._planner,
                              shape=lambda p: (p.rows, *self.image_shape))  # fmt: skip
        self._split = self._entry.split
        self._tokens = self._entry_over(self.program, output=_token_rows, split=self._split)
        self._vq = jaxsync.TowerProgram(model, _modules.vq_outputs)  # no rows to place
        self._programs.append(self._vq)
        self._planner = images_planner(self.cfg, lambda x: self._split(x)[0], buckets=buckets,
                                       missing_code_id=missing_code_id)  # fmt: skip

    def plan(self, num_images: int, *, batch_shards: int = 1) -> ChameleonPlan:
        """The host plan of `num_images` images with this encoder's buckets and vocabulary."""
        return plan(num_images, self.cfg, buckets=self.buckets, batch_shards=batch_shards,
                    missing_code_id=self.missing_code_id)  # fmt: skip

    @jaxsync.check.entry_point
    def __call__(self, pixel_values) -> jaxsync.Embeddings:
        """Images -> their image-token rows, as `jaxsync.Embeddings`.

        Args:
          pixel_values: `[B, C, R, R]` normalised pixels: numpy or a torch CPU tensor (as
            `ChameleonImageProcessor` returns them; refused if not finite), or a device array.

        Returns:
          `Embeddings.of(forward(...), plan)`: rows `[Bp*T, D]` in the model dtype, the text
          embedding of each image token (image `i` at rows `i*T : (i+1)*T`, raster order; with
          `encoder_only`, `[Bp*T, latent_channels]` latents); `.split()` gives `[T, D]` per image.
          Extras: "ids" int32 `[Bp*T]`, the rows' BPE ids; "finite" bool `[Bp]` (on the device),
          False where an image held a NaN or inf, and for padding.

        Raises:
          TypeError: wrong type or dtype, a torch tensor off the CPU.
          ValueError: wrong rank or image size, no image, non-finite host pixels, a deleted
            array, pixels apart from the weights or split off the batch axis.
        """
        return self._entry(pixel_values)

    @jaxsync.check.entry_point
    def get_image_tokens(self, pixel_values) -> Int[Array, "B T"]:
        """BPE ids `[B, T]` of each image's tokens in raster order (HF `get_image_tokens`)."""
        return self._tokens(pixel_values)

    def encode(self, pixel_values: jax.Array) -> tuple[Float[Array, "B h w L"], Int[Array, "B T"]]:
        """The VQ model's own outputs, unbucketed (for parity): encoder latents (NHWC, before
        `quant_conv`) and VQ codes of device pixels."""
        check_device_array(pixel_values, PIXELS)
        check_pixels(pixel_values, self.image_shape)
        return self._vq(pixel_values)


def _token_rows(out: jaxsync.Encoded, p: Planned) -> jax.Array:
    return token_rows(out.extras["ids"], p.plan.num_images, p.plan.tokens_per_image)
