# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""`ChameleonImageEncoder`: Chameleon's image tower behind one host object.

Pixels -> VQ codes -> BPE image-token ids -> their text embedding rows in one dispatch of
`jaxsync.TowerProgram(model, forward)`: the ids are gathered through a device copy of `img2bpe`
(upstream reads the codes back to the CPU for the lookup), so nothing is read back. The same
object offers the text-side paths of `ChameleonTextPaths` (logit mask, masked logits, merge).
"""

from __future__ import annotations

import functools as ft
import os
from operator import attrgetter

import jax
from jaxtyping import Array, Float, Int

import jaxsync
import jaxsync.check
from jaxsync._batching import BucketEntry, Warmer, committed
from jaxsync._calls import reads
from jaxsync._encoder import TowerEncoder, expect
from jaxsync._entry import Planned, TowerEntry
from jaxsync._out_sharding import OutSharding
from jaxsync._placement import check_devices
from jaxsync.models.chameleon._modules import (
    ChameleonImageTower,
    forward,
    forward_encoder_only,
    token_rows,
    vq_outputs,
)
from jaxsync.models.chameleon._plan import (
    ChameleonPlan,
    bucket_batch_sizes,
    check_pixels,
    host_pixels,
    plan,
)
from jaxsync.models.chameleon._text import ChameleonTextPaths
from jaxsync.models.chameleon._vocab import check_device_array
from jaxsync.models.chameleon._weights import load_model


PIXELS = "pixel_values"


def _as_embeddings(out: jaxsync.Encoded, p: Planned) -> jaxsync.Embeddings:
    return p.finish(out)  # `Embeddings.of(out, plan)` with the plan's row layout computed once


def _as_token_rows(out: jaxsync.Encoded, p: Planned) -> jax.Array:
    return token_rows(out.extras["ids"], p.plan.num_images, p.plan.tokens_per_image)


class ChameleonImageEncoder(ChameleonTextPaths, TowerEncoder):
    """Image tower of one Chameleon model (and its text-side paths).

    Args:
      model: the tower (`load_model`, or `ChameleonImageTower(cfg, rngs=...)`); its `cfg` is the
        encoder's.
      encoder_only: the rows are the VQ encoder's hidden states (latents before `quant_conv`,
        `[T, latent_channels]` per image) instead of the embedded image tokens.
      buckets: image-count buckets (default `IMAGE_BUCKETS`: 1, 4, 8, ...).
      missing_code_id: see `ImageVocabularyMapping` (None: a VQ code without a name is an
        error).
      cache: the `DeviceCache` for the text-side tables (default: the process-wide one).
      placement, out_sharding: as `TowerEncoder`'s; pixels (host ones at `placement`) may be
        split over a mesh's data axis (dimension 0) and nowhere else, and the batch is then
        padded to a multiple of that axis.

    One program per batch bucket (see `TowerEncoder`); a bucket's first call also compiles the
    row slices (and device pixels' pads) of every batch size in it, so later calls compile
    nothing.
    """

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
        self.missing_code_id = missing_code_id
        self.encoder_only = bool(encoder_only)
        self.buckets = buckets
        vq = self.cfg.vq
        self.image_shape = (vq.in_channels, vq.resolution, vq.resolution)
        self.tokens_per_image = vq.tokens_per_image
        # Repeated calls on device pixels, one entry per output form over one plan cache; a
        # bucket's first call warms its per-batch-size row slices (and device pixels' pads).
        checks = (_live, self._check_pixels, self._check_placing)
        t = self.tokens_per_image
        sizes = lambda rows, where: bucket_batch_sizes(rows, buckets, self._split.shards(where))  # noqa: E731
        warm = Warmer(sizes, lambda out, n: token_rows(out.extras["ids"], n, t))
        kind = ft.partial(BucketEntry, batch=attrgetter("rows"), warm=warm, to_host=host_pixels)
        TowerEncoder.__init__(
            self,
            model,
            forward_encoder_only if self.encoder_only else forward,
            name=PIXELS,
            checks=checks,
            placement=placement,
            out_sharding=out_sharding,
            entry=ft.partial(kind, output=_as_embeddings),
        )
        self._split = self._entry.split  # how a batch is split over a data axis, per placement
        self._tokens = self._entry_over(self.program, output=_as_token_rows, split=self._split)
        self._vq = jaxsync.TowerProgram(model, vq_outputs)
        self._programs.append(self._vq)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype=None, mesh=None, **kwargs
    ) -> ChameleonImageEncoder:
        """Reads `config.json` and the tower's weights of a checkpoint directory."""
        return cls(load_model(path, dtype=dtype, mesh=mesh), **kwargs)

    def plan(self, num_images: int, *, batch_shards: int = 1) -> ChameleonPlan:
        """The host plan of `num_images` images with this encoder's buckets and vocabulary."""
        return plan(
            num_images,
            self.cfg,
            buckets=self.buckets,
            batch_shards=batch_shards,
            missing_code_id=self.missing_code_id,
        )

    # ------------------------------------------------------------ image tokens

    @jaxsync.check.entry_point
    def __call__(self, pixel_values) -> jaxsync.Embeddings:
        """Images -> their image-token rows, as `jaxsync.Embeddings`.

        Args:
          pixel_values: `[B, C, R, R]` normalised pixels: numpy or a torch CPU tensor (what
            `ChameleonImageProcessor` returns; refused if not finite), or a device `jax.Array`
            (possibly sharded over a mesh's data axis).

        Returns:
          `Embeddings.of(forward(...), plan)`: rows `[Bp*T, D]` in the model dtype, the text
          embedding of each image token (image `i` at rows `i*T : (i+1)*T`, raster order; rows
          past `B*T` are bucket padding; with `encoder_only`, the VQ encoder's latents
          `[Bp*T, latent_channels]`); `.split()` gives per-image `[T, D]` arrays. Extras:
          "ids" int32 `[Bp*T]`, the BPE ids of the same rows; "finite" bool `[Bp]`, False where
          an image held a NaN or inf, and for padding (computed on the device, never read back).

        Raises:
          TypeError: wrong type or dtype, a torch tensor off the CPU.
          ValueError: wrong rank or image size, no image, non-finite host pixels, a deleted
            (donated) array, or pixels placed apart from the weights or split off the batch axis.
        """
        return self._run(pixel_values, self._entry)

    @jaxsync.check.entry_point
    def get_image_tokens(self, pixel_values) -> Int[Array, "B T"]:
        """BPE ids `[B, T]` of each image's tokens in raster order (HF `get_image_tokens`)."""
        return self._run(pixel_values, self._tokens)

    def encode(self, pixel_values: jax.Array) -> tuple[Float[Array, "B h w L"], Int[Array, "B T"]]:
        """The VQ model's own outputs, unbucketed (for parity): encoder latents (NHWC, before
        `quant_conv`) and VQ codes of device pixels."""
        check_device_array(pixel_values, "pixel_values")
        check_pixels(pixel_values, self.image_shape)
        return self._vq(pixel_values)

    @reads("shape", "dtype")
    def _check_pixels(self, pixel_values) -> int:
        return check_pixels(pixel_values, self.image_shape)

    @reads("sharding", "committed")
    def _check_placing(self, pixel_values: jax.Array) -> None:
        """Committed pixels on the weights' devices (uncommitted ones may move)."""
        if committed(pixel_values) is not None:
            check_devices(pixel_values, self._weights, PIXELS)

    def _run(self, pixel_values, entry: TowerEntry):
        """The call through `entry` (one per output form); a repeated call on device pixels
        runs the call it kept."""
        run, key = entry.calls.find(pixel_values)
        if run is not None:
            return run(pixel_values)
        shape = lambda p: (p.rows, *self.image_shape)  # noqa: E731
        return entry.run(pixel_values, key, self._planner, shape=shape)

    def _planner(self, pixels, where):
        n, shards = pixels.shape[0], self._split(pixels)[0]
        return (n, shards, where), lambda: self.plan(n, batch_shards=shards)


@reads("type", "live")
def _live(pixel_values) -> None:
    check_device_array(pixel_values, PIXELS)
