"""The host entry of the GLM-4.1V vision tower: validate, plan (cached), upload, one dispatch."""

from __future__ import annotations

import jax

import jaxsync
from jaxsync._encoder import TowerEncoder, expect
from jaxsync._entry import alive
from jaxsync._out_sharding import OutSharding
from jaxsync.check import entry_point
from jaxsync.models.glm4v import _modules, _plan
from jaxsync.models.glm4v._inputs import PIXELS, padded, pixel_check
from jaxsync.models.glm4v._modules import Glm4vVisionTower, forward, forward_encoder_only
from jaxsync.models.glm4v._plan import AttentionLayout, Glm4vBuckets, Glm4vPlan
from jaxsync.models.glm4v._weights import load_model


_pos_program = jax.jit(_modules.pos_embeds)


class Glm4vVisionEncoder(TowerEncoder):
    """Host entry around a `Glm4vVisionTower`: host plan, one packed upload, one dispatch of
    `jaxsync.TowerProgram(model, forward)` (see `TowerEncoder`).

    Args:
      model: the tower (e.g. from `load_model`).
      buckets: the static sizes plans pad to (default `Glm4vBuckets()`).
      layout: how each image / frame attends only to itself (`AttentionLayout`: "ragged",
        "dense", "segments" or "auto", the default).
      encoder_only: return the tokens before the patch merger as the rows (no merger runs).
      placement, plan_cache_size, out_sharding: as `TowerEncoder`'s.

    Attributes:
      cfg: the tower's config (`model.cfg`, with its resolved attention).
      layout: the layout in use ("auto" resolved).
      buckets: the checked buckets.
    """

    load_model = staticmethod(load_model)

    def __init__(
        self,
        model: Glm4vVisionTower,
        *,
        buckets: Glm4vBuckets | None = None,
        placement=None,
        plan_cache_size: int = 64,
        layout: AttentionLayout = "auto",
        encoder_only: bool = False,
        out_sharding: OutSharding = None,
    ):
        expect(model, Glm4vVisionTower)
        self.devices = len(model.post_layernorm.weight[...].sharding.device_set)
        self.layout = _plan.resolve_layout(layout, model.cfg.attention, self.devices)
        self.dtype, self.buckets = model.dtype, _plan.check_buckets(buckets)
        self.encoder_only = bool(encoder_only)
        self._took(model)
        super().__init__(
            model,
            forward_encoder_only if self.encoder_only else forward,
            name=PIXELS,
            checks=(pixel_check(model.cfg.patch_dim, model.dtype), alive(PIXELS)),
            inside=PIXELS,
            placement=placement,
            out_sharding=out_sharding,
            fits=padded,
            plan_cache_size=plan_cache_size,
            plan_of=self._planner,
            shape=lambda p: (p.padded_patches, model.cfg.patch_dim),
            dtype=self.dtype,
        )

    def _took(self, model: Glm4vVisionTower) -> None:
        self._table = model.embeddings.position_embedding[...]  # what `pos_embeds` reads

    def plan(self, grid_thw, num_patches: int | None = None) -> Glm4vPlan:
        """The host plan of a batch with this encoder's buckets and layout (validates
        `grid_thw`)."""
        return _plan.plan(grid_thw, self.cfg, buckets=self.buckets, layout=self.layout,
                          devices=self.devices, num_patches=num_patches)  # fmt: skip

    def _planner(self, grid_thw):
        return _plan.grid_planner(grid_thw, self.cfg, buckets=self.buckets, layout=self.layout,
                                  devices=self.devices)  # fmt: skip

    @entry_point
    def __call__(self, pixel_values, image_grid_thw) -> jaxsync.Embeddings:
        """Encodes a packed batch of images and videos (the image processor's outputs).

        Args:
          pixel_values: [sum(t*h*w), C*T*p*p] flattened patches in merge-block order, as the HF
            image processor emits them (numpy or a torch CPU tensor), or a device array already
            padded to the bucket (`plan(...).padded_patches` rows, zeros past the real ones).
          image_grid_thw: [B, 3] host (t, h, w) per item, in patches (numpy, list, torch CPU).

        Returns:
          `Embeddings.of(forward(...), plan)`: merged tokens [G_bucket, out_hidden_size], item i
          at `offsets[i]` (t*h*w / m^2 rows); extras "hidden" (the rows before the merger; none
          with `encoder_only`, whose rows they are) and "finite" (bool [I_bucket], on device).

        Raises (before any upload or compile):
          TypeError: non-integer or device `image_grid_thw`, non-float pixels.
          ValueError: an empty batch, bad shapes, h/w not multiples of the merge size, a patch
            count that does not match the grid, non-finite host pixels, device pixels away from
            the weights or not padded to the bucket.
        """
        return self._entry(pixel_values, image_grid_thw)

    @entry_point
    def pos_embeds(self, image_grid_thw) -> jax.Array:
        """Interpolated position embeddings of a batch alone: [P_bucket, D] in the model dtype
        (upstream's `pos_embeds_interpolate`); rows >= sum(t*h*w) are padding."""
        key, build = self._planner(image_grid_thw)(None, self._meta_at)
        return _pos_program(self._table, self._entry.planned(key, build, self._meta_at).meta)
